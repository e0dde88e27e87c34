"""What a generation tells its consumer, in order: Queued*, Started, Delta*, Done (or Refused alone).

A thinking model's (Qwen3, DeepSeek-R1 distills) answer starts with ``<think>...</think>``: the engines split the
thinking from the answer, once, as the text streams (``Splitter``: ``Delta.reasoning`` beside ``Delta.text``), so
every transport sends it apart and the store keeps it apart. A tag may come split across tokens (held back until
it is whole or cannot be one), the close tag may never come (an answer cut inside its thinking: all of it is
thinking), and a template may open ``<think>`` in the prompt itself, so the output starts inside the thinking.
Text that does not start with ``<think>`` is answer, untouched.
"""
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
    reasoning: str = ""  # a thinking model's thinking (``reasoning_content``), kept apart from the answer


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


# ---- a thinking model's thinking, split from its answer

OPEN, CLOSE = "<think>", "</think>"

_START, _INSIDE, _AFTER, _ANSWER = range(4)


def thinks(template: object) -> bool:
    """Whether a chat template is a thinking model's: it writes or reads ``<think>``, or takes
    ``enable_thinking`` (Qwen3's)."""
    return isinstance(template, str) and (OPEN in template or "enable_thinking" in template)


def opens(suffix: str) -> bool:
    """Whether a template's generation prompt (what it writes after the last message) leaves ``<think>``
    open, so the model's output starts inside its thinking (DeepSeek-R1's templates)."""
    i = suffix.rfind(OPEN)
    return i >= 0 and CLOSE not in suffix[i:]


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag that may be coming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Splitter:
    """One answer's text in, (thinking, answer) pieces out. The thinking comes without the blank lines
    around it, the answer without those after ``</think>``; joined, the pieces are the whole of each."""

    def __init__(self, inside: bool = False) -> None:
        self.state = _INSIDE if inside else _START
        self.held = ""  # text that may be (part of) a tag, or blank space whose fate is not known yet
        self.fresh = True  # no thinking out yet: its leading blank space is dropped

    @property
    def thinking(self) -> bool:
        """Whether the text is inside the thinking now."""
        return self.state == _INSIDE

    def push(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that ``text`` completes."""
        buf, self.held = self.held + text, ""
        reasoning = answer = ""
        while buf:
            if self.state == _START:
                stripped = buf.lstrip()
                if stripped.startswith(OPEN):
                    self.state, buf = _INSIDE, stripped[len(OPEN):]
                elif OPEN.startswith(stripped):  # blank, or a tag still coming
                    self.held = buf
                    break
                else:
                    self.state = _ANSWER
            elif self.state == _INSIDE:
                if self.fresh:
                    buf = buf.lstrip()
                    if buf.startswith(OPEN):  # the model writes the tag its prompt already opened
                        buf = buf[len(OPEN):]
                        continue
                    if buf and OPEN.startswith(buf):
                        self.held = buf
                        break
                at = buf.find(CLOSE)
                if at >= 0:
                    reasoning += buf[:at].rstrip()
                    self.state, buf = _AFTER, buf[at + len(CLOSE):]
                    continue
                keep = _partial(buf, CLOSE)
                body = buf[:len(buf) - keep]
                out = body.rstrip()
                reasoning += out
                self.fresh = self.fresh and not out
                self.held = body[len(out):] + buf[len(buf) - keep:]
                break
            elif self.state == _AFTER:
                buf = buf.lstrip()
                if buf:
                    self.state = _ANSWER
            else:
                answer += buf
                break
        if reasoning:
            self.fresh = False
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """What is still held when the answer ends: thinking cut short keeps what it had."""
        held, self.held = self.held, ""
        if self.state == _INSIDE:
            out = held.rstrip()
            return (out.lstrip() if self.fresh else out), ""
        if self.state == _START:
            return "", held
        return "", ""
