"""The engine interface the web layer sees: parameters, a generation's events, submit/cancel.

No torch here: engines (local model, remote backend) produce events into a
``Generation`` from real OS threads; the consumer iterates them.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ..concurrency import Channel


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


_ids = itertools.count(1)


@dataclass
class Generation:
    """One answer being made: the engine ``emit``s events, the consumer iterates them.

    Events are dicts: ``{"type": "queued", "position": n}``,
    ``{"type": "start", "prompt_tokens": n}``, ``{"type": "delta", "text": s}``,
    ``{"type": "done", "reason": r, "usage": {...}, "timings": {...}}`` (always last).
    """

    messages: list
    params: GenParams
    key: str | None = None  # conversation key for prefix-cache reuse
    prompt_ids: list | None = None  # set by engines that tokenize at submit time
    serial: int = field(default_factory=lambda: next(_ids))
    cancel_reason: str | None = None
    finished: bool = False
    channel: Channel = field(default_factory=Channel)
    submitted_at: float = field(default_factory=time.monotonic)
    on_cancel: object = None  # engine hook: called (from the canceller) after cancel()

    def emit(self, event: dict) -> None:
        """Called by the engine, from any thread."""
        if event["type"] == "done":
            self.finished = True
        self.channel.put(event)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine to end this generation at its next step with ``done`` ``reason``."""
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason
            if self.on_cancel is not None:
                self.on_cancel(self)

    def next_event(self, timeout: float | None = None):
        """The next event, or None on timeout."""
        return self.channel.get(timeout)

    def __iter__(self):
        """Every event up to and including ``done`` (or an ``error`` before ``start``)."""
        try:
            while True:
                event = self.channel.get()
                yield event
                if event["type"] in ("done", "error"):
                    return
        finally:
            self.close()

    def close(self) -> None:
        self.channel.close()


class Engine:
    """What the web layer needs from an engine (local model or remote backend)."""

    model_name: str = "model"
    ready: bool = False
    error: str | None = None

    def submit(self, messages: list, params: GenParams, key: str | None = None) -> Generation:
        """Queue a generation for ``messages`` (system/user/assistant dicts); never blocks."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Active and queued counts for health and metrics."""
        return {"active": 0, "queued": 0}

    def drain(self) -> None:
        """Stop taking new requests; the ones already taken go on."""

    def shutdown(self, reason: str = "shutdown") -> None:
        """End every generation with ``done`` ``reason`` and stop the engine."""
