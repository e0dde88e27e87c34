"""A run: one answer pumped from the engine to the store and to every connection that follows it.

Runs outlive a dropped socket: each keeps every delta, so a client that
reconnects can ``resume`` from any index while the run goes on and for a
grace period after it ends. Several sockets of the client may follow one run at
once (two tabs on one conversation): each gets every frame and its own ``done``;
the run is cancelled only when the last of them is gone for the grace. This module also declares what the turn service
needs from wherever runs are kept (``RunRegistry``, ``RunHandle``): this process
alone, or every worker through Redis (``chat.state``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from . import structured
from .concurrency import cooperate, spawn
from .engine import Generation
from .engine.events import Delta, Done, Event, Queued, Refused, Started
from .errors import StorageFull
from .unsaved import NOT_STORED, Unsaved

log = logging.getLogger(__name__)

CHECKPOINT_EVERY_S = 1.0
REPLAY_SLICE = 256  # replayed deltas between two turns of the event loop


class Subscriber(Protocol):
    """Where a run's frames go: a WebSocket session."""

    def send(self, frame: dict) -> bool:
        """Deliver one frame; False once the connection is gone."""

    def adopt(self, run: RunHandle) -> None:
        """The run now sends its frames here."""

    def forget(self, run: RunHandle) -> None:
        """The run ended: nothing more comes to this connection."""


class RunHandle(Protocol):
    """A run as a connection sees it: a ``Run`` this worker owns, or one that another worker
    owns, followed through Redis (``chat.state.redis_runs.RemoteRun``)."""

    id: str
    client: str
    finished: bool

    def cancel(self, reason: str = "cancelled") -> None:
        """End the answer with ``done`` ``reason`` (a no-op once it finished)."""

    def attach(self, subscriber: Subscriber, start: int) -> None:
        """Replay deltas from ``start``, then continue live (or send ``done``), beside any other
        connection already following the run."""

    def detach(self, subscriber: Subscriber) -> None:
        """``subscriber`` went away; once no one follows, the resume grace decides the rest."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended (True), or ``timeout`` passed (False)."""


class RunRegistry(Protocol):
    """Every run by (client, request id), and which conversations are busy answering.

    ``chat.state.local_runs.LocalRuns`` keeps them for this process;
    ``chat.state.redis_runs.RedisRuns`` also for every worker (resume and cancel anywhere).
    """

    def get(self, client: str, rid: str) -> RunHandle | None:
        """The run ``rid`` of ``client`` (active, or ended within the resume grace), or None."""

    def active(self, client: str, rid: str) -> bool:
        """Whether ``rid`` of ``client`` is still answering."""

    def busy(self, conversation_id: str) -> bool:
        """Whether a request is answering in the conversation."""

    def claim(self, conversation_id: str, client: str, rid: str) -> bool:
        """Mark the conversation busy for this request; False when another request has it."""

    def unclaim(self, conversation_id: str, client: str, rid: str) -> None:
        """Free the conversation if this request holds it."""

    def add(self, run: Run) -> None:
        """Register a run this worker just started."""

    def release(self, run: Run) -> None:
        """The run ended: its conversation is free (the run stays resumable until ``forget``)."""

    def forget(self, run: Run) -> None:
        """The resume grace is over: the run is gone."""

    def followed(self, run: Run) -> bool:
        """Whether a socket on another worker follows ``run`` (so its grace must not cancel it)."""

    def all_active(self) -> list[Run]:
        """This worker's runs still answering."""

    def answering(self, client: str | None, conversation_id: str) -> dict | None:
        """The run answering in ``client``'s conversation as {``id``, ``message_id``, ``prefix_chars``},
        or None (also when another client's request holds it)."""

    def answering_in(self, client: str | None, conversation_ids: list[str]) -> set[str]:
        """Which of ``client``'s conversations a request of it is answering in now."""


def whole_answer(before: dict, usage: dict, timings: dict) -> tuple[dict, dict]:
    """The figures of an answer ``continue`` extended: the stored ones (``before``: its ``usage`` and
    ``timings``) and the new part's, as one answer: every token, the first token's wait, the speed
    over both parts' decoding time."""
    old_usage, old_timings = before.get("usage") or {}, before.get("timings") or {}
    old_n, new_n = old_usage.get("completion_tokens"), usage.get("completion_tokens")
    if not isinstance(old_n, int) or not isinstance(new_n, int):
        return usage, timings
    whole_usage = {**usage, "completion_tokens": old_n + new_n,
                   "prompt_tokens": old_usage.get("prompt_tokens", usage.get("prompt_tokens"))}
    whole_timings = dict(timings)
    if old_timings.get("ttft_ms") is not None:
        whole_timings["ttft_ms"] = old_timings["ttft_ms"]
    if isinstance(old_timings.get("total_ms"), (int, float)) and isinstance(timings.get("total_ms"), (int, float)):
        whole_timings["total_ms"] = round(old_timings["total_ms"] + timings["total_ms"], 1)
    seconds = 0.0
    for n, rate in ((old_n, old_timings.get("tokens_per_s")), (new_n, timings.get("tokens_per_s"))):
        if not n:
            continue
        if not isinstance(rate, (int, float)) or rate <= 0:
            return whole_usage, whole_timings  # a part's speed unknown: the new part's stands
        seconds += n / rate
    if seconds > 0:
        whole_timings["tokens_per_s"] = round((old_n + new_n) / seconds, 1)
    return whole_usage, whole_timings


class RunStore(Protocol):
    """The two store writes a run makes (``chat.store.Store`` has them)."""

    def save_partial(self, message_id: str, content: str, reasoning: str | None = None) -> None:
        """Checkpoint a streaming answer's text (and a thinking model's thinking) so far."""

    def finish_assistant(self, message_id: str, content: str, reason: str,
                         usage: dict | None = None, timings: dict | None = None, reasoning: str | None = None) -> None:
        """Store the answer's final text (and thinking) and how it ended."""


class RunOwner(Protocol):
    """What a run needs from whoever started it (``chat.turns.TurnService``): where the answer is
    stored, the registry that frees its conversation, the end of a generation counted and logged,
    and how long an ended or abandoned run waits for a resume."""

    @property
    def store(self) -> RunStore: ...

    @property
    def runs(self) -> RunRegistry: ...

    @property
    def resume_grace_s(self) -> float: ...

    @property
    def unsaved(self) -> Unsaved: ...

    def record(self, end: Done | Refused, transport: str, id: str, conversation: str | None = None,
               prompt: str | None = None, text: str | None = None) -> None:
        """Count the outcome in the metrics and write the generation's log line."""


class Run:
    """One answer: the replay buffer, store checkpoints, metrics and the log line (via its owner)."""

    def __init__(self, owner: RunOwner, client: str, rid: str, conversation_id: str, message_id: str,
                 gen: Generation, subscriber: Subscriber | None, prefix: str = "", before: dict | None = None) -> None:
        self.owner, self.client, self.id = owner, client, rid
        self.prefix = prefix  # continue: the answer's text so far, which the deltas extend
        # a thinking model's thinking; a continued answer's stored one, unless it was cut inside it (no text
        # yet: then it is answered afresh, thinking again)
        self.thoughts = (before.get("reasoning") or "") if before and before.get("content") else ""
        self.thinking_at: float | None = None  # when its thinking began streaming
        self.thinking_ms: float | None = None  # how long it thought (until the answer's first text, or the end)
        self.reasoning: dict[int, str] = {}  # delta index -> the thinking that delta carries
        self.before = before  # continue: the stored answer (its usage and timings, for the whole answer's)
        self.conversation_id, self.message_id, self.gen = conversation_id, message_id, gen
        self.deltas: list[str] = []
        self.tokens = 0  # the answer's tokens so far, as the last delta said (0: unknown)
        self.done_frame: dict | None = None
        self.started = False
        self.finished = False
        self.subscribers: list[Subscriber] = [subscriber] if subscriber is not None else []
        self.mirror: Callable[[dict], None] | None = None  # in Redis: appends each frame to the run's stream
        self.lock = threading.RLock()
        self.finished_event = threading.Event()
        self.last_checkpoint = time.monotonic()
        self.after: Callable[[Run], None] | None = None  # once it ended and its conversation is free

    @property
    def store(self) -> RunStore:
        return self.owner.store

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine to end the answer with ``done`` ``reason`` (a no-op once it finished)."""
        self.gen.cancel(reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended (True), or ``timeout`` passed (False)."""
        return self.finished_event.wait(timeout)

    def pump(self) -> None:
        """Consume the generation's events until the last (runs in its own greenlet/thread)."""
        try:
            self.gen.consume(self.handle)
        except Exception:
            log.exception("run %s failed", self.id)
            self.gen.cancel("error")
            self.on_done(Done("error"))
        finally:
            self.finish()

    def handle(self, event: Event) -> None:
        """One engine event (in the pump's greenlet, or in the remote engine's that emitted it)."""
        if type(event) is Delta:  # nearly every event
            if event.reasoning:  # a thinking model's thinking: frames of its own, before the text that follows
                self.on_delta("", event.tokens if not event.text else 0, (), event.reasoning)
                if not event.text and not event.logprobs:
                    return
            self.on_delta(event.text, event.tokens, event.logprobs)
            return
        match event:
            case Queued(position=position):
                self.forward({"type": "queued", "id": self.id, "position": position})
            case Started():
                self.send_start()
            case Refused():
                self.on_refused(event)
            case Done():
                self.on_done(event)

    def send_start(self) -> None:
        """The ``start`` frame, once."""
        if not self.started:
            self.started = True
            self.forward({"type": "start", "id": self.id, "conversation_id": self.conversation_id,
                          "message_id": self.message_id})

    def on_delta(self, text: str, tokens: int = 0, logprobs: tuple = (), reasoning: str = "") -> None:
        """Keep the delta for replay, send it (with the answer's tokens so far, when the engine counts them, its
        tokens' log probabilities and a remote model's reasoning, when there are), and checkpoint the text now
        and then."""
        with self.lock:
            index = len(self.deltas)
            self.deltas.append(text)
            self.tokens = tokens or self.tokens
            if reasoning:
                self.reasoning[index] = reasoning
                self.thoughts += reasoning
                if self.thinking_at is None:
                    self.thinking_at = time.monotonic()
            elif text and self.thinking_at is not None and self.thinking_ms is None:
                self.thinking_ms = round((time.monotonic() - self.thinking_at) * 1000, 1)
            frame = {"type": "delta", "id": self.id, "index": index, "text": text}
            if tokens:
                frame["tokens"] = tokens
            if logprobs:
                frame["logprobs"] = list(logprobs)
            if reasoning:
                frame["reasoning"] = reasoning
            self.forward(frame)
        now = time.monotonic()
        if now - self.last_checkpoint >= CHECKPOINT_EVERY_S:
            self.last_checkpoint = now
            self.write(self.store.save_partial, self.message_id, self.prefix + "".join(self.deltas),
                       self.thoughts or None)

    def write(self, method: Callable[..., object], *args) -> None:
        """A store write the answer goes on without: a full store is logged there, the client still gets it."""
        try:
            method(*args)
        except StorageFull:
            pass

    def save(self, text: str, reason: str, usage: dict, timings: dict) -> bool:
        """The answer's final write; whether it is stored (a full store: kept in memory, saved later)."""
        reasoning = self.thoughts or None
        try:
            self.store.finish_assistant(self.message_id, text, reason, usage, timings, reasoning)
        except StorageFull:
            self.owner.unsaved.keep(self.message_id, text, reason, usage, timings, reasoning)
            return False
        return True

    def on_refused(self, event: Refused) -> None:
        """The engine refused the answer: stored as an error, sent as an error frame."""
        self.save(self.prefix, "error", {}, {})
        self.owner.record(event, "ws", self.id, self.conversation_id)
        self.forward({"type": "error", "id": self.id, "code": event.code, "message": event.message})

    def on_done(self, event: Done) -> None:
        """Store the whole answer, record it, send ``done``."""
        self.send_start()  # a request cancelled while queued still gets start, then done
        text = self.prefix + "".join(self.deltas)
        usage, timings = event.usage, event.timings
        if self.thinking_at is not None:  # how long it thought: the page shows it, now and on reload
            if self.thinking_ms is None:
                self.thinking_ms = round((time.monotonic() - self.thinking_at) * 1000, 1)
            timings = {**timings, "thinking_ms": self.thinking_ms}
        elif self.before is not None and (self.before.get("timings") or {}).get("thinking_ms") is not None:
            timings = {**timings, "thinking_ms": self.before["timings"]["thinking_ms"]}
        if self.before is not None:  # the stored answer's figures cover all of it; done, the new part
            usage, timings = whole_answer(self.before, usage, timings)
        stored = self.save(text, event.reason, usage, timings)
        self.owner.record(event, "ws", self.id, self.conversation_id,
                            prompt=self.gen.messages[-1]["content"], text=text)
        frame: dict = {"type": "done", "id": self.id, "reason": event.reason, "usage": event.usage,
                 "timings": event.timings if self.thinking_ms is None else {**event.timings,
                                                                             "thinking_ms": self.thinking_ms}}
        if event.notice:
            frame["message"] = event.notice
        if not stored:  # the client has all of it; the store will once it has space
            frame["stored"] = False
            frame.setdefault("message", NOT_STORED)
        if self.gen.params.tools:  # the answer's <tool_call> blocks, read back (the text keeps them)
            calls = structured.parse_calls(text, self.message_id or self.id)[1]
            if calls:
                frame["tool_calls"] = calls
        with self.lock:
            self.done_frame = frame
            self.forward(frame)

    def finish(self) -> None:
        """The pump ended: free the conversation; the run stays resumable for the grace."""
        self.finished = True
        self.owner.runs.release(self)
        self.finished_event.set()
        with self.lock:
            subscribers, self.subscribers = self.subscribers, []
        for subscriber in subscribers:
            subscriber.forget(self)
        spawn(self._expire)
        if self.after is not None:
            spawn(self.after, self)

    def _expire(self) -> None:
        time.sleep(self.owner.resume_grace_s)
        self.owner.runs.forget(self)

    def forward(self, frame: dict) -> None:
        """One frame to the run's stream (in Redis) and to every connection following it."""
        if self.mirror is not None:
            self.mirror(frame)
        subscribers = self.subscribers
        if len(subscribers) == 1:  # nearly always
            if not subscribers[0].send(frame):
                self.detach(subscribers[0])
            return
        for subscriber in list(subscribers):
            if not subscriber.send(frame):
                self.detach(subscriber)

    def attach(self, subscriber: Subscriber, start: int) -> None:
        """Replay deltas from ``start``, then continue live (or send ``done``). Connections already
        following the run keep following it."""
        with self.lock:
            self.subscribers = [s for s in self.subscribers if s is not subscriber]
            last = len(self.deltas) - 1
            for index in range(start, len(self.deltas)):
                frame = {"type": "delta", "id": self.id, "index": index, "text": self.deltas[index]}
                if index in self.reasoning:
                    frame["reasoning"] = self.reasoning[index]
                if index == last and self.tokens:  # the count so far rides on the last replayed delta
                    frame["tokens"] = self.tokens
                if not subscriber.send(frame):
                    self._orphaned()
                    return
                if index % REPLAY_SLICE == REPLAY_SLICE - 1:
                    cooperate()  # a long replay lets the other connections run now and then
            if self.done_frame is not None:
                subscriber.send(self.done_frame)
            else:
                self.subscribers = [*self.subscribers, subscriber]

    def detach(self, subscriber: Subscriber) -> None:
        """A connection went away: once none follows, cancel after the grace unless someone resumes."""
        with self.lock:
            if subscriber not in self.subscribers:
                return
            self.subscribers = [s for s in self.subscribers if s is not subscriber]
            self._orphaned()

    def _orphaned(self) -> None:
        """No connection follows any more: the grace starts (call with the lock held)."""
        if not self.subscribers and not self.finished:
            spawn(self._cancel_unless_resumed)

    def _cancel_unless_resumed(self) -> None:
        runs = self.owner.runs
        time.sleep(self.owner.resume_grace_s)
        while not self.subscribers and not self.finished and runs.followed(self):
            time.sleep(self.owner.resume_grace_s or 1)
        if not self.subscribers and not self.finished:
            self.cancel("cancelled")
