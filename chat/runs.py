"""A run: one answer pumped from the engine to the store and to whichever connection is attached.

Runs outlive a dropped socket: each keeps every delta, so a client that
reconnects can ``resume`` from any index while the run goes on and for a
grace period after it ends. This module also declares what the turn service
needs from wherever runs are kept (``RunRegistry``, ``RunHandle``): this process
alone, or every worker through Redis (``chat.state``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from . import structured
from .concurrency import cooperate, spawn
from .engine import Generation
from .engine.events import Delta, Done, Event, Queued, Refused, Started
from .errors import StorageFull

if TYPE_CHECKING:
    from .store import Store
    from .turns import TurnService

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
        """The run ended, or moved to another connection."""


class RunHandle(Protocol):
    """A run as a connection sees it: a ``Run`` this worker owns, or one that another worker
    owns, followed through Redis (``chat.state.redis_runs.RemoteRun``)."""

    id: str
    client: str
    finished: bool

    def cancel(self, reason: str = "cancelled") -> None:
        """End the answer with ``done`` ``reason`` (a no-op once it finished)."""

    def attach(self, subscriber: Subscriber, start: int) -> None:
        """Replay deltas from ``start``, then continue live (or send ``done``)."""

    def detach(self, subscriber: Subscriber) -> None:
        """``subscriber`` went away; the resume grace decides the rest."""

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


class Run:
    """One answer: the replay buffer, store checkpoints, metrics and the log line (via the service)."""

    def __init__(self, service: TurnService, client: str, rid: str, conversation_id: str, message_id: str,
                 gen: Generation, subscriber: Subscriber | None, prefix: str = "") -> None:
        self.service, self.client, self.id = service, client, rid
        self.prefix = prefix  # continue: the answer's text so far, which the deltas extend
        self.conversation_id, self.message_id, self.gen = conversation_id, message_id, gen
        self.deltas: list[str] = []
        self.done_frame: dict | None = None
        self.started = False
        self.finished = False
        self.subscriber = subscriber
        self.mirror: Callable[[dict], None] | None = None  # in Redis: appends each frame to the run's stream
        self.lock = threading.RLock()
        self.finished_event = threading.Event()
        self.last_checkpoint = time.monotonic()

    @property
    def store(self) -> Store:
        return self.service.store

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
            self.on_delta(event.text)
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

    def on_delta(self, text: str) -> None:
        """Keep the delta for replay, send it, and checkpoint the text now and then."""
        with self.lock:
            index = len(self.deltas)
            self.deltas.append(text)
            self.forward({"type": "delta", "id": self.id, "index": index, "text": text})
        now = time.monotonic()
        if now - self.last_checkpoint >= CHECKPOINT_EVERY_S:
            self.last_checkpoint = now
            self.write(self.store.save_partial, self.message_id, self.prefix + "".join(self.deltas))

    def write(self, method: Callable[..., object], *args) -> None:
        """A store write the answer goes on without: a full store is logged there, the client still gets it."""
        try:
            method(*args)
        except StorageFull:
            pass

    def on_refused(self, event: Refused) -> None:
        """The engine refused the answer: stored as an error, sent as an error frame."""
        self.write(self.store.finish_assistant, self.message_id, self.prefix, "error", {}, {})
        self.service.record(event, "ws", self.id, self.conversation_id)
        self.forward({"type": "error", "id": self.id, "code": event.code, "message": event.message})

    def on_done(self, event: Done) -> None:
        """Store the whole answer, record it, send ``done``."""
        self.send_start()  # a request cancelled while queued still gets start, then done
        text = self.prefix + "".join(self.deltas)
        self.write(self.store.finish_assistant, self.message_id, text, event.reason, event.usage, event.timings)
        self.service.record(event, "ws", self.id, self.conversation_id,
                            prompt=self.gen.messages[-1]["content"], text=text)
        frame = {"type": "done", "id": self.id, "reason": event.reason, "usage": event.usage,
                 "timings": event.timings}
        if self.gen.params.tools:  # the answer's <tool_call> blocks, read back (the text keeps them)
            calls = structured.parse_calls(text)[1]
            if calls:
                frame["tool_calls"] = calls
        with self.lock:
            self.done_frame = frame
            self.forward(frame)

    def finish(self) -> None:
        """The pump ended: free the conversation; the run stays resumable for the grace."""
        self.finished = True
        self.service.runs.release(self)
        self.finished_event.set()
        if self.subscriber is not None:
            self.subscriber.forget(self)
        spawn(self._expire)

    def _expire(self) -> None:
        time.sleep(self.service.settings.resume_grace_s)
        self.service.runs.forget(self)

    def forward(self, frame: dict) -> None:
        """One frame to the run's stream (in Redis) and to the attached connection."""
        if self.mirror is not None:
            self.mirror(frame)
        subscriber = self.subscriber
        if subscriber is not None and not subscriber.send(frame):
            self.detach(subscriber)

    def attach(self, subscriber: Subscriber, start: int) -> None:
        """Replay deltas from ``start``, then continue live (or send ``done``)."""
        with self.lock:
            old = self.subscriber
            self.subscriber = None
            if old is not None and old is not subscriber:
                old.forget(self)
            for index in range(start, len(self.deltas)):
                if not subscriber.send({"type": "delta", "id": self.id, "index": index,
                                        "text": self.deltas[index]}):
                    return
                if index % REPLAY_SLICE == REPLAY_SLICE - 1:
                    cooperate()  # a long replay lets the other connections run now and then
            if self.done_frame is not None:
                subscriber.send(self.done_frame)
            else:
                self.subscriber = subscriber

    def detach(self, subscriber: Subscriber) -> None:
        """The connection went away: cancel after the grace period unless someone resumes."""
        with self.lock:
            if self.subscriber is not subscriber:
                return
            self.subscriber = None
        if not self.finished:
            spawn(self._cancel_unless_resumed)

    def hand_over(self) -> None:
        """A socket on another worker resumed this run: stop sending to the one here."""
        with self.lock:
            old, self.subscriber = self.subscriber, None
        if old is not None:
            old.forget(self)
        if not self.finished:
            spawn(self._cancel_unless_resumed)

    def _cancel_unless_resumed(self) -> None:
        runs = self.service.runs
        time.sleep(self.service.settings.resume_grace_s)
        while self.subscriber is None and not self.finished and runs.followed(self):
            time.sleep(self.service.settings.resume_grace_s or 1)
        if self.subscriber is None and not self.finished:
            self.cancel("cancelled")
