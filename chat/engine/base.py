"""The engine interface the web layer sees: parameters, a generation and its events, submit/cancel.

No torch here: engines (local model, remote backend) emit typed events (``events.py``)
into a ``Generation`` from real OS threads; the consumer iterates them.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..concurrency import Channel
from .events import END, Delta, Event


@dataclass
class GenParams:
    """Per-request sampling parameters (already validated)."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple = ()
    model: str | None = None  # one of Engine.models(); None: the engine's default (model_name)
    grammar: str | None = None  # an llguidance grammar the answer must follow (chat/structured.py)
    logprobs: int | None = None  # None: none; else each token's log probability and this many alternatives
    prompt_logprobs: int | None = None  # likewise for every prompt token (/v1/completions with echo)
    raw_prompt: bool = False  # the one message's content is the prompt as is, no chat template
    tools: tuple = ()  # OpenAI function tools the prompt lists (the template's own way, else a generic one)
    # Whose KV the prompt may reuse besides public preambles: conversations of the same salt (the client's
    # identity, hashed), as vLLM's per-tenant cache salt; None: the engine's public namespace.
    cache_salt: str | None = None
    tool_mode: str | None = None  # the grammar is tool calls (tool_choice auto, required or a name)
    # Work for the server, not an answer someone waits on (a conversation's title): the local engine starts it
    # only while no other answer decodes, prefills or waits, so it never slows one.
    background: bool = False
    enable_thinking: bool | None = None  # a thinking model's switch, passed to its template (None: its default)
    upstream: dict = field(default_factory=dict)  # those fields as a remote engine passes them on (remote/fields.py)


_ids = itertools.count(1)
_WAKE = object()  # tells consume() that an event handled in the emitting greenlet was the last


@dataclass(eq=False)
class Generation:
    """One answer being made: the engine ``emit``s events, the consumer iterates ``events()``.

    This is what the web side sees of a request. Set by the engine that makes it and never
    changed afterwards: ``messages``, ``params``, ``key``, ``owner``, ``notify``. Whatever else an engine keeps
    per request (prompt ids, queue position, an upstream connection) lives in the engine, keyed
    by the generation.
    """

    messages: list
    params: GenParams
    key: str | None = None  # conversation key for prefix-cache reuse
    owner: str | None = None  # whose answer (the client's address): the engine shares prefill between owners
    notify: Callable[["Generation"], None] | None = field(default=None, repr=False)  # the engine's; see cancel()
    serial: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = field(default=None, init=False)
    finished: bool = field(default=False, init=False)
    channel: Channel = field(default_factory=Channel, init=False, repr=False)
    observers: list = field(default_factory=list, init=False, repr=False)  # see observe()
    sink: Callable[[Event], None] | None = field(default=None, init=False, repr=False)  # see consume()

    def emit(self, event: Event) -> None:
        """Called by the engine, from any thread; the last event is a ``Done`` or ``Refused``.

        From a greenlet of the consumer's thread, this may run the consumer's handler (``consume``)
        and so block while it sends.
        """
        if type(event) is not Delta:  # observers follow the lifecycle; deltas are nearly every event
            if isinstance(event, END):
                self.finished = True
            for observer in self.observers:
                observer(event)
        sink = self.sink
        if sink is not None and len(self.channel) == 0 and self.channel.local():
            sink(event)
        else:
            self.channel.put(event)

    def observe(self, observer: Callable[[Event], None]) -> None:
        """Call ``observer`` with each event but deltas (the lifecycle: queued, started, the end)
        the engine emits, whether or not anyone consumes them.

        Events emitted before this call (still in the channel) are replayed to it; one emitted
        meanwhile may reach it twice, so an observer must be idempotent.
        """
        self.observers.append(observer)
        for event in self.channel.peek():
            if type(event) is not Delta:
                observer(event)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine to end this generation at its next step with ``Done`` ``reason``
        (the engine's ``notify`` hook wakes it, once)."""
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason
            if self.notify is not None:
                self.notify(self)

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None on timeout."""
        return self.channel.get(timeout)

    def events(self, keepalive: float | None = None) -> Iterator[Event | None]:
        """Every event up to and including the last; None each ``keepalive`` seconds of silence."""
        try:
            while True:
                event = self.channel.get(keepalive)
                yield event
                if isinstance(event, END):
                    return
        finally:
            self.close()

    __iter__ = events

    def consume(self, handle: Callable[[Event], None]) -> None:
        """``handle`` every event up to and including the last, in order; raises what it raises.

        An event that a greenlet of the consumer's own thread emits (the remote engine's) while
        the consumer waits is handled right there, in the emitting greenlet: no channel and no
        wake-up of the consumer, two greenlet switches and a loop callback fewer per delta.
        Events from another thread (the local engine's), and any emitted while a handler is busy,
        go through the channel as with ``events()``.
        """
        outcome: list = []  # what ended the stream when it ended in the emitting greenlet

        def direct(event: Event) -> None:
            self.sink = None  # while this handler runs (it may block), later events queue behind
            try:
                handle(event)
            except Exception as exc:
                outcome.append(exc)
                self.channel.put(_WAKE)
                return
            if isinstance(event, END):
                outcome.append(None)
                self.channel.put(_WAKE)
            else:
                self.sink = direct

        try:
            while True:
                self.sink = direct
                event = self.channel.get()
                self.sink = None
                if outcome and outcome[0] is not None:
                    raise outcome[0]  # before any event that queued behind the failed one
                if event is _WAKE:
                    return
                handle(event)
                if isinstance(event, END):
                    return
        finally:
            self.sink = None
            self.close()

    def close(self) -> None:
        """Release the channel; events emitted afterwards are dropped."""
        self.channel.close()


class Engine:
    """What the web layer needs from an engine (local model or remote backend)."""

    model_name: str = "model"
    vocab_size: int | None = None  # the model's vocabulary (top_k's bound), when the engine knows it
    ready: bool = False
    error: str | None = None
    loading: dict | None = None  # while not ready: a long load step's {"step", "done", "total"}, for /readyz

    def submit(self, messages: list, params: GenParams, key: str | None = None,
               owner: str | None = None) -> Generation:
        """Queue a generation for ``messages`` (system/user/assistant dicts); never blocks. ``owner``:
        whose it is (the client's address), so that one owner's prompts cannot crowd out others'.

        Raises an ``EngineError`` (``Overloaded``, ``PromptTooLong``...) when refused at once.
        """
        raise NotImplementedError

    def models(self) -> list[str]:
        """The models a request may name (``GenParams.model``), the default (``model_name``) first."""
        return [self.model_name]

    def stats(self) -> dict:
        """Active and queued counts for health and metrics."""
        return {"active": 0, "queued": 0}

    def describe(self) -> dict:
        """What ``/readyz`` shows of a ready engine beyond its model's name: the local engine's weights (what its
        decode step multiplies by: "int4", "blocks", "bfloat16"...), CPU class, formats per class of product,
        decode step, idle chores and draft counts ({} for an engine with nothing to tell)."""
        return {}

    def thinks(self) -> bool:
        """Whether the default model is a thinking model (its template writes ``<think>``): the page offers
        its switch (``enable_thinking``)."""
        return False

    def count_tokens(self, text: str) -> int | None:
        """How many tokens ``text`` is for the default model (None when the engine cannot say)."""
        return None

    def forget(self, key: str) -> None:
        """A conversation was deleted: drop whatever the engine keeps for ``key`` (its KV, in memory and on disk)."""

    def drain(self) -> None:
        """Stop taking new requests; the ones already taken go on."""

    def shutdown(self, reason: str = "shutdown") -> None:
        """End every generation with ``Done`` ``reason`` and stop the engine."""
