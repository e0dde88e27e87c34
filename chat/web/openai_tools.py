"""The structured parts of ``/v1/chat/completions``: ``response_format``, ``tools``/``tool_choice``,
``logprobs``/``top_logprobs``, checked into engine parameters, and the answer's tool calls and log
probabilities in OpenAI's shapes (whole and streamed). The rules live in ``chat/structured.py``.
"""
from __future__ import annotations

from typing import Any

from .. import structured
from ..concurrency import run_in_thread
from ..errors import RequestError

MAX_TOP_LOGPROBS = 20


def _bad(name: str, message: str) -> RequestError:
    return RequestError("invalid_value", f"'{name}' {message}", 400, name)


def messages(value: Any) -> Any:
    """A history's tool calls and tool results as text turns (``structured.history``)."""
    return structured.history(value) if isinstance(value, list) else value


def _plan(body: dict) -> dict:
    """Engine parameters from the structured fields of a checked body (runs on a real thread:
    a schema's check is CPU work)."""
    out: dict = {}
    listed = structured.tools(body["tools"]) if body.get("tools") is not None else []
    choice = body.get("tool_choice")
    choice = structured.tool_choice(choice, listed) if choice is not None else ("auto" if listed else "none")
    if choice != "none" and not listed:
        raise _bad("tool_choice", "needs 'tools'")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    fmt = body.get("response_format")
    grammar = structured.response_format(fmt) if fmt is not None else None
    if listed:
        out["tools"] = tuple(listed)
    if choice != "none" and listed:
        if grammar is not None:
            raise RequestError("unsupported_value", "'response_format' cannot be combined with tool calls; "
                               "use tool_choice 'none' for a formatted answer", 400, "response_format")
        grammar = structured.tools_grammar(listed, choice, parallel)
        out["tool_mode"] = choice
    if grammar is not None:
        out["grammar"] = grammar
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "must be a boolean")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not logprobs:
            raise _bad("top_logprobs", "needs 'logprobs': true")
    if logprobs:
        out["logprobs"] = top or 0
    return out


def plan(body: dict) -> dict:
    """``_plan`` off the event loop."""
    if not any(body.get(k) is not None for k in ("tools", "tool_choice", "response_format", "logprobs",
                                                  "top_logprobs", "parallel_tool_calls")):
        return {}
    return run_in_thread(_plan, body)


def message(text: str, tool_mode: str | None) -> tuple[dict, str | None]:
    """(the assistant message, ``tool_calls`` as the finish reason when the answer called tools)."""
    if tool_mode:
        content, calls = structured.parse_calls(text)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, None


class CallStream:
    """Streamed text in, OpenAI chunk deltas out: plain text as ``content``; ``<tool_call>`` blocks held
    until whole, then sent as ``tool_calls`` deltas (index, id, name, then the arguments)."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0

    def push(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self.buf:
            start = self.buf.find(structured.OPEN)
            if start < 0:
                # keep what could be the start of a call marker
                keep = next((k for k in range(min(len(structured.OPEN) - 1, len(self.buf)), 0, -1)
                             if structured.OPEN.startswith(self.buf[-k:])), 0)
                if len(self.buf) > keep:
                    out.append({"content": self.buf[:len(self.buf) - keep]})
                    self.buf = self.buf[len(self.buf) - keep:]
                break
            if start > 0:
                out.append({"content": self.buf[:start]})
                self.buf = self.buf[start:]
            end = self.buf.find(structured.CLOSE)
            if end < 0:
                break
            block = self.buf[:end + len(structured.CLOSE)]
            self.buf = self.buf[end + len(structured.CLOSE):].lstrip("\n")
            out += self._call(block)
        return out

    def _call(self, block: str) -> list[dict]:
        rest, calls = structured.parse_calls(block)
        if not calls:
            return [{"content": block}]
        fn = calls[0]["function"]
        index = self.calls
        self.calls += 1
        return [{"tool_calls": [{"index": index, "id": calls[0]["id"], "type": "function",
                                 "function": {"name": fn["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}]

    def flush(self) -> list[dict]:
        out = [{"content": self.buf}] if self.buf else []
        self.buf = ""
        return out
