"""What a generation tells its consumer, in order: Queued*, Started, Delta*, Done (or Refused alone)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Queued:
    """Waiting for engine capacity; ``position`` 1 is next."""

    position: int


@dataclass(frozen=True)
class Started:
    """The prompt was accepted; generation has begun."""

    prompt_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """A piece of the answer's text; with log probabilities asked for, one entry per token it covers."""

    text: str
    logprobs: tuple = ()  # OpenAI's entries: {"token", "logprob", "bytes", "top_logprobs"}
    prompt_logprobs: tuple = ()  # once, before the answer: one per prompt token (the first's logprob None)
    tokens: int = 0  # the answer's tokens so far, this delta's included (0: the engine cannot say)
    reasoning: str = ""  # a remote model's reasoning (``reasoning_content``), kept apart from the answer


@dataclass(frozen=True)
class Refused:
    """Refused before start (e.g. the prompt does not fit); always the last event."""

    code: str
    message: str


@dataclass(frozen=True)
class Done:
    """The answer ended; always the last event after ``Started``."""

    reason: str
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    timings: dict = field(default_factory=lambda: {"ttft_ms": None, "total_ms": 0, "tokens_per_s": 0})
    reused_tokens: int = 0
    message: str | None = None  # what went wrong, for reason ``error`` (for the log: may name a backend's URL)
    notice: str | None = None  # what the client is told of it (safe to show), when there is something

    @classmethod
    def build(cls, reason: str, prompt_tokens: int, completion_tokens: int, submitted_at: float,
              first_delta_at: float | None, reused_tokens: int = 0, message: str | None = None,
              notice: str | None = None) -> "Done":
        """The one place usage and timings are computed: decode rate counts tokens after the first."""
        now = time.monotonic()
        decode_s = now - first_delta_at if first_delta_at is not None else 0.0
        rate = (completion_tokens - 1) / decode_s if decode_s > 0 and completion_tokens > 1 else 0.0
        ttft = first_delta_at - submitted_at if first_delta_at is not None else None
        return cls(reason,
                   {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                   {"ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
                    "total_ms": round((now - submitted_at) * 1000, 1), "tokens_per_s": round(rate, 2)},
                   reused_tokens, message, notice)


Event = Queued | Started | Delta | Refused | Done
END = (Done, Refused)  # the event types that end a generation


def announce(plan: Any, done: Callable[..., None]) -> None:
    """Tell what the scheduler decided (a ``scheduler.Plan``): who ended (``done(gen, reason, slot)``) or was
    refused unstarted, who started, who waits where; then the plan's lists are empty."""
    for gen, reason, slot in plan.ended:
        done(gen, reason, slot)
    for gen, exc in plan.refused:
        gen.emit(Refused(exc.code, exc.message))
    for slot in plan.started:
        slot.gen.emit(Started(len(slot.prompt_ids)))
    for gen, position in plan.queued:
        gen.emit(Queued(position))
    for told in (plan.ended, plan.refused, plan.started, plan.queued):
        told.clear()
