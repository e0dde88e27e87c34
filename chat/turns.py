"""The turn service both transports use: history → prompt → params → submit → store → the run.

The WebSocket and ``/v1`` adapters parse a request, call this service, and
serialize what comes back; every rule about a turn is written here once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

from . import attachments as files
from .concurrency import spawn
from .engine import GenParams, Generation
from .engine.events import Done, Refused
from .errors import ProtocolError
from .limits import Limits
from .runs import Run, RunHandle, RunRegistry, Subscriber
from .store import new_id
from .unsaved import Unsaved
from .titles import Titler

if TYPE_CHECKING:
    from .config import Settings
    from .engine import Engine
    from .metrics import Metrics
    from .store import Store

log = logging.getLogger(__name__)


class TurnRequest(Protocol):
    """What the service reads from a validated request (``chat.web.protocol.Request``)."""

    @property
    def id(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def conversation_id(self) -> str | None: ...
    @property
    def message_id(self) -> str | None: ...
    @property
    def system(self) -> str | None: ...
    @property
    def params(self) -> dict: ...
    @property
    def structured(self) -> dict: ...
    @property
    def attachments(self) -> list: ...
    @property
    def model(self) -> str | None: ...


def cache_salt(client: str | None) -> str:
    """Whose KV a turn may reuse (GenParams.cache_salt): its client's own, by a hash of its identity;
    every ``/v1`` caller (no identity) shares one namespace, apart from every WebSocket client's."""
    if client is None:
        return "v1"
    return hashlib.sha256(client.encode()).hexdigest()[:32]


class TurnService:
    """Turns for every client of one process: checks, the engine, the store, the runs."""

    def __init__(self, settings: Settings, engine: Engine, store: Store | None, metrics: Metrics, limits: Limits,
                 runs: RunRegistry) -> None:
        self.settings, self.engine, self._store = settings, engine, store
        self.metrics, self.limits = metrics, limits
        self.runs = runs
        # finished answers a full store refused, written when space returns (chat/unsaved.py)
        self.unsaved = Unsaved(lambda *args: self.store.finish_assistant(*args))

    @property
    def store(self) -> Store:
        """The conversation store: every turn but ``answer`` (``/v1``) needs it; an engine-only process has none."""
        if self._store is None:
            raise RuntimeError("this process keeps no conversations (CHAT_ENGINE_ONLY)")
        return self._store

    @property
    def resume_grace_s(self) -> float:
        """How long an ended run stays resumable, and an abandoned one waits for a socket (``RunOwner``)."""
        return self.settings.resume_grace_s

    # ---- building a turn

    def params(self, given: dict, model: str | None = None) -> GenParams:
        """Sampling parameters: the request's (GenParams names), else the server's; max tokens capped."""
        s = self.settings
        return GenParams(temperature=given.get("temperature", s.temperature),
                         top_p=given.get("top_p", s.top_p),
                         max_new_tokens=min(given.get("max_new_tokens", s.max_new_tokens), s.max_new_tokens),
                         top_k=given.get("top_k", 0), min_p=given.get("min_p", 0.0),
                         seed=given.get("seed"), stop=tuple(given.get("stop", ())), model=model,
                         grammar=given.get("grammar"), logprobs=given.get("logprobs"),
                         prompt_logprobs=given.get("prompt_logprobs"), raw_prompt=given.get("raw_prompt", False),
                         tools=tuple(given.get("tools", ())), cache_salt=given.get("cache_salt"),
                         tool_mode=given.get("tool_mode"), upstream=given.get("upstream", {}),
                         enable_thinking=given.get("enable_thinking"))

    def model(self, wanted: str | None, rid: str | None = None) -> str | None:
        """``wanted`` when the engine serves it (None: its default); bad_message when it does not."""
        if wanted is None or wanted == self.engine.model_name:
            return None
        if wanted not in self.engine.models():
            raise ProtocolError("bad_message", f"the model {wanted!r} is not served here", rid)
        return wanted

    def _options(self, conv_id: str, req: TurnRequest) -> tuple[dict, str | None]:
        """(params, model) of a turn: the request's over the conversation's own settings. A stored
        model the engine no longer serves gives way to its default."""
        stored = self.store.options(conv_id)
        model = stored["model"] if stored["model"] in self.engine.models() else None
        if req.model is not None:
            model = self.model(req.model, req.id)
        return {**stored["params"], **req.params}, model

    def prompt(self, messages: list, system: str | None = None) -> list:
        """The messages the model sees: a system prompt first when they bring none."""
        system = system or self.settings.system_prompt
        if system and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": system}, *messages]
        return messages

    # ---- WebSocket turns: stored, resumable

    def chat(self, client: str, address: str, req: TurnRequest, subscriber: Subscriber) -> Run:
        """Append ``req.content`` (and its attachments) to the conversation's active path (a new
        conversation without ``conversation_id``) and answer."""
        model = self.model(req.model, req.id)
        self._check_new(client, req)
        if req.conversation_id is not None:
            self._check_owner(client, req)
        self._check_busy(req)
        new = req.conversation_id is None
        conv_id = new_id() if req.conversation_id is None else req.conversation_id
        history = [] if new else self._history(conv_id)
        asked = {"role": "user", "content": files.with_attachments(req.content, req.attachments)}
        messages = self.prompt(history + [asked], req.system if new else None)

        def write() -> None:
            if not new:
                self.store.add_user_message(client, conv_id, req.content, req.attachments)
                return
            # What the first turn was asked with becomes the conversation's own settings.
            self.store.create_conversation(client, system=req.system or self.settings.system_prompt, id=conv_id,
                                           params=req.params, model=model, address=address)
            try:
                self.store.add_user_message(client, conv_id, req.content, req.attachments)
            except BaseException:  # no empty "New chat" left behind by a refused first message
                self.store.delete(client, conv_id)
                raise
        run = self._start(client, address, req, conv_id, messages, write, subscriber)
        if new and self.settings.titles:
            run.after = lambda ended: self._title(ended, req.content, model, address, subscriber)
        return run

    def _title(self, run: Run, question: str, model: str | None, address: str, subscriber: Subscriber) -> None:
        """After a new conversation's first answer (finished, not cut off by an error): the model titles
        it, and the connection that asked hears the title in a ``title`` frame."""
        done = run.done_frame or {}
        answer = run.prefix + "".join(run.deltas)
        if done.get("reason") not in ("stop", "length", "cancelled") or not answer.strip():
            return
        conv_id = run.conversation_id
        Titler(self.engine, self.store).write(
            conv_id, question, answer, model, address,
            lambda title: subscriber.send({"type": "title", "conversation_id": conv_id, "title": title}))

    def edit(self, client: str, address: str, req: TurnRequest, subscriber: Subscriber) -> Run:
        """A new version of a user message on the active path (same parent, same files), answered;
        what followed the old version stays on its branch."""
        conv_id = cast(str, req.conversation_id)  # required by edit, regenerate and continue (protocol.py)
        edited = self._target(client, req, self.store.user_message, req.message_id)
        # The path above the edited message ("" when it is the first: no messages at all).
        history = self._history(conv_id, upto=edited["parent_id"] or "")
        asked = {"role": "user", "content": files.with_attachments(req.content, edited["attachments"])}

        def write() -> None:
            self.store.add_user_message(client, conv_id, req.content, edited["attachments"],
                                        replaces=req.message_id, retitle=not self.settings.titles)
        return self._start(client, address, req, conv_id, self.prompt(history + [asked]), write, subscriber)

    def regenerate(self, client: str, address: str, req: TurnRequest, subscriber: Subscriber) -> Run:
        """Answer a user message again (that of ``message_id``, else the last): a new version
        beside the old answer, which is kept."""
        conv_id = cast(str, req.conversation_id)
        question = self._target(client, req, self.store.question_for, req.message_id)
        history = self._history(conv_id, upto=question["id"])
        return self._start(client, address, req, conv_id, self.prompt(history), None, subscriber,
                           parent_id=question["id"])

    def continue_(self, client: str, address: str, req: TurnRequest, subscriber: Subscriber) -> Run:
        """Extend the last answer, cut short, in place: the model sees its turn left open and
        the deltas append to its text."""
        conv_id = cast(str, req.conversation_id)
        answer = self._target(client, req, self.store.continuable)
        history = self._history(conv_id)
        if answer["content"]:  # an empty answer is simply answered afresh
            history[-1] = {**history[-1], "prefix": True}

        def write() -> None:
            self.store.reopen_assistant(answer["id"])
        return self._start(client, address, req, conv_id, self.prompt(history), write, subscriber,
                           extend=answer)

    def cancel(self, client: str, rid: str) -> None:
        """End request ``rid`` with ``done`` ``cancelled`` (a no-op once it finished)."""
        self.run_of(client, rid, "no request {!r} on this client").cancel("cancelled")

    def resume(self, client: str, rid: str, start: int, subscriber: Subscriber) -> RunHandle:
        """Attach ``subscriber`` to request ``rid``: replay from delta ``start``, then live."""
        run = self.run_of(client, rid, "no request {!r} to resume")
        subscriber.adopt(run)
        run.attach(subscriber, start)
        if run.finished:
            subscriber.forget(run)
        return run

    def run_of(self, client: str, rid: str, missing: str) -> RunHandle:
        run = self.runs.get(client, rid)
        if run is None:
            raise ProtocolError("unknown_id", missing.format(rid), rid)
        return run

    def _check_new(self, client: str, req: TurnRequest) -> None:
        if self.runs.active(client, req.id):
            raise ProtocolError("duplicate_id", f"request {req.id!r} is already active", req.id)

    def _check_owner(self, client: str, req: TurnRequest) -> None:
        if not self.store.owns(client, req.conversation_id):
            raise ProtocolError("not_found", "no such conversation", req.id)

    def _history(self, conv_id: str, upto: str | None = None) -> list:
        """The stored path the model sees, at most CHAT_MAX_MESSAGES of its newest turns."""
        if self.unsaved:  # an answer the full store refused belongs in the history: written first if it can be
            self.unsaved.flush()
        return self.store.history(conv_id, upto=upto, limit=self.settings.max_messages or None)

    def _target(self, client: str, req: TurnRequest, lookup: Callable[..., Any], *args) -> Any:
        """Checks for a request on a stored message: a new id, this client's conversation, then
        ``lookup`` (whose bad_message outranks busy), then not busy. Returns what it found."""
        self._check_new(client, req)
        self._check_owner(client, req)
        try:
            found = lookup(client, req.conversation_id, *args)
        except ProtocolError as exc:
            exc.id = req.id
            raise
        self._check_busy(req)
        return found

    def _check_busy(self, req: TurnRequest) -> None:
        if req.conversation_id is not None and self.runs.busy(req.conversation_id):
            raise ProtocolError("busy", "this conversation is already answering", req.id)

    def _submit(self, address: str, client: str | None, rid: str | None, messages: list, params: GenParams,
                key: str | None = None) -> Generation:
        """Admit against the limits (last of the checks: a refused request spends no token), then submit.

        The answer counts against ``client`` and ``address`` until the engine ends it.
        """
        ticket = self.limits.admit(address, client, rid)
        params = replace(params, cache_salt=params.cache_salt or cache_salt(client))
        try:
            gen = self.engine.submit(messages, params, key=key, owner=address)
        except BaseException:
            ticket.release()
            raise
        self.limits.track(ticket, gen)
        return gen

    def _start(self, client: str, address: str, req: TurnRequest, conv_id: str, messages: list,
               write: Callable[[], None] | None, subscriber: Subscriber,
               parent_id: str | None = None, extend: dict | None = None) -> Run:
        """Claim the conversation, submit, then store; a store failure (quota, full disk) cancels the
        generation instead of orphaning it. The answer is a new message under ``parent_id`` (default:
        the active leaf), or with ``extend`` that stored answer, whose text the deltas continue."""
        if not self.runs.claim(conv_id, client, req.id):  # the check above raced another request
            raise ProtocolError("busy", "this conversation is already answering", req.id)
        try:
            params, model = self._options(conv_id, req)  # a new conversation: not stored yet, no settings
            params = {**params, **getattr(req, "structured", {})}  # never stored with the conversation
            gen = self._submit(address, client, req.id, messages, self.params(params, model), key=conv_id)
        except BaseException:
            self.runs.unclaim(conv_id, client, req.id)
            raise
        try:
            if write is not None:
                write()
            message_id = extend["id"] if extend else self.store.start_assistant(conv_id, parent_id)
        except BaseException:
            gen.cancel("error")
            gen.close()
            self.runs.unclaim(conv_id, client, req.id)
            raise
        run = Run(self, client, req.id, conv_id, message_id, gen, subscriber,
                  prefix=extend["content"] if extend else "", before=extend)
        self.runs.add(run)
        subscriber.adopt(run)
        spawn(run.pump)
        return run

    # ---- /v1 turns: stateless

    def answer(self, address: str, messages: list, given: dict, model: str | None = None) -> Generation:
        """Submit a whole conversation the caller brings (to ``model``, one of the engine's); nothing is
        stored; counted per address only."""
        return self._submit(address, None, None, self.prompt(messages),
                            self.params(given, None if model == self.engine.model_name else model))

    # ---- the end of a connection

    def forget_anonymous(self, client: str, runs: list[RunHandle]) -> None:
        """No one can reach a cookie-less connection's conversations again: delete them once its runs end."""
        def forget() -> None:
            for run in runs:
                run.wait()
            for conversation in self.store.list_conversations(client):
                self.engine.forget(conversation["id"])  # its KV too, in memory and on disk
            self.store.forget_client(client)
        spawn(forget)

    # ---- the end of every turn

    def record(self, end: Done | Refused, transport: str, id: str, conversation: str | None = None,
               prompt: str | None = None, text: str | None = None) -> None:
        """Count the outcome in the metrics and write the one log line of a generation."""
        if isinstance(end, Refused):
            self.metrics.errors.labels(end.code).inc()
            end = Done(f"refused:{end.code}", message=end.message)
        else:
            self.metrics.finished(end)
        usage, timings = end.usage, end.timings
        extra: dict[str, object] = {}
        if text is not None:
            extra["chars"] = len(text)
        if self.settings.log_content and text is not None:
            extra.update(prompt=prompt, text=text)
        log.info("generation %s", json.dumps({
            "transport": transport, "conversation": conversation, "id": id, "reason": end.reason,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "ttft_ms": timings.get("ttft_ms"), "tokens_per_s": timings.get("tokens_per_s"),
            "reused_tokens": end.reused_tokens, **extra}))
        if end.reason == "error" and end.message:
            log.error("generation %s failed: %s", id, end.message)

    def shutdown(self, timeout: float) -> None:
        """Stop taking turns, let answers finish within ``timeout``, end the rest with ``shutdown``."""
        log.info("shutting down: letting %d answers finish", len(self.runs.all_active()))
        self.engine.drain()
        deadline = time.monotonic() + max(0.0, timeout)
        while self.runs.all_active() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.engine.shutdown("shutdown")
        deadline = time.monotonic() + 5
        while self.runs.all_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._store is not None:
            self.unsaved.close()
