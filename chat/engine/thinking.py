"""Thinking models (Qwen3, DeepSeek-R1 distills): an answer that starts with ``<think>...</think>``.

The engine splits the thinking from the answer here, once, as the text streams (``Delta.reasoning`` beside
``Delta.text``), so every transport sends it apart and the store keeps it apart. A tag may come split
across tokens (held back until it is whole or cannot be one), the close tag may never come (an answer cut
inside its thinking: all of it is thinking), and a template may open ``<think>`` in the prompt itself, so
the output starts inside the thinking. Text that does not start with ``<think>`` is answer, untouched.
"""
from __future__ import annotations

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
