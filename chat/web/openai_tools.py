"""The structured parts of ``/v1/chat/completions``: ``response_format``, ``tools``/``tool_choice``,
``logprobs``/``top_logprobs``, checked into engine parameters, and the answer's tool calls and log
probabilities in OpenAI's shapes (whole and streamed). The rules live in ``chat/structured.py``.
"""
from __future__ import annotations

import json
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
    parallel = body.get("parallel_tool_calls", False)  # several calls only when asked (a small model loops)
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
    # as a remote engine passes them on (parallel_tool_calls always: the default here is one call), with a
    # history's tool calls and results as OpenAI writes them (the upstream's own template renders them)
    out["upstream"] = {k: v for k, v in (("response_format", fmt), ("tools", listed or None),
                                         ("tool_choice", body.get("tool_choice")),
                                         ("parallel_tool_calls", parallel if listed else None),
                                         ("messages", _native(body.get("messages")))) if v is not None}
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


def _native(messages: Any) -> list | None:
    """A history with tool calls or tool results, as the client sent it (checked already), else None."""
    if not isinstance(messages, list) or not any(
            isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages):
        return None
    keep = ("role", "content", "name", "tool_calls", "tool_call_id")
    return [{**{k: m[k] for k in keep if m.get(k) is not None},
             **({"role": "system"} if m.get("role") == "developer" else {})} for m in messages if isinstance(m, dict)]


def plan(body: dict) -> dict:
    """``_plan`` off the event loop."""
    if not any(body.get(k) is not None for k in ("tools", "tool_choice", "response_format", "logprobs",
                                                  "top_logprobs", "parallel_tool_calls")):
        return {}
    return run_in_thread(_plan, body)


def message(text: str, tool_mode: str | None, seed: str | None = None) -> tuple[dict, str | None]:
    """(the assistant message, ``tool_calls`` as the finish reason when the answer called tools); ``seed``:
    the answer's id, which the calls' ids derive from (``structured.call_id``)."""
    if tool_mode:
        content, calls = structured.parse_calls(text, seed)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, None


class CallStream:
    """Streamed text in, OpenAI chunk deltas out: plain text as ``content``; a ``<tool_call>`` block as
    ``tool_calls`` deltas: first the index, id and name, then the arguments in fragments as the model
    writes them (the grammar writes ``{"name": ..., "arguments": ...}`` in that order). The arguments'
    fragments join to exactly the call's JSON arguments. A call that repeats an earlier one is held back
    while it does and dropped when it ends the same (as ``structured.parse_calls`` drops it); ids come
    from ``seed`` as the whole form's do."""

    HOLD = len("}\n" + structured.CLOSE) + 8  # never send what may be the end of the call
    TAIL = "\n" + structured.CLOSE

    def __init__(self, seed: str | None = None) -> None:
        self.buf = ""
        self.seed = seed
        self.calls = 0
        self.call: dict | None = None  # the call being streamed: its index, whether its head went out
        self.after = False  # a call ended: the newlines between calls are not text
        self.blocks: list[str] = []  # the calls sent so far, as written
        self.seen: set[str] = set()  # and as JSON

    def push(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self.buf:
            if self.call is not None:
                if not self._in_call(out):
                    break
                continue
            if self.after:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.after = False
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
            self.call = {"index": self.calls, "head": None, "sent": 0}
        return out

    def _in_call(self, out: list[dict]) -> bool:
        """Send what the call's text allows; True when the call ended (the rest is in ``buf``)."""
        call, body = self.call, self.buf[len(structured.OPEN):]
        assert call is not None
        end = body.find(structured.CLOSE)
        if call["head"] is None and self.blocks:
            if end < 0 and any(b.startswith(self.buf) for b in self.blocks):
                return False  # so far the same as an earlier call: it may repeat it
            if end >= 0 and self._repeated(self.buf[:len(structured.OPEN) + end + len(structured.CLOSE)]):
                self._close(len(structured.OPEN) + end)
                self.calls -= 1
                return True
        if call["head"] is None:
            head = structured.HEAD.match(body)
            if head is None or (end >= 0 and head.end() > end):
                if end < 0:
                    return False
                out += self._whole(self.buf[:len(structured.OPEN) + end + len(structured.CLOSE)])
                self._close(len(structured.OPEN) + end)
                return True
            call["head"] = head.end()
            call["id"] = structured.call_id(self.seed, call["index"])
            out.append({"tool_calls": [{"index": call["index"], "id": call["id"], "type": "function",
                                        "function": {"name": head.group(1), "arguments": ""}}]})
        args = body[call["head"]:end] if end >= 0 else body[call["head"]:]
        if end >= 0:
            args = args.rstrip()[:-1].rstrip()  # the call object's closing brace
            upto = len(args)
        else:
            upto = max(call["sent"], len(args) - self.HOLD)
        if upto > call["sent"]:
            out.append({"tool_calls": [{"index": call["index"], "function": {"arguments": args[call["sent"]:upto]}}]})
            call["sent"] = upto
        if end < 0:
            return False
        self._repeated(self.buf[:len(structured.OPEN) + end + len(structured.CLOSE)])  # remembered
        self._close(len(structured.OPEN) + end)
        return True

    def _repeated(self, block: str) -> bool:
        """Whether a whole call block repeats an earlier call; remembers it when it does not."""
        match = structured._CALL.match(block)
        try:
            same = json.dumps(json.loads(match.group(1)), sort_keys=True) if match else block
        except ValueError:
            same = block
        if same in self.seen:
            return True
        self.seen.add(same)
        self.blocks.append(block)
        return False

    def _close(self, end: int) -> None:
        self.buf = self.buf[end + len(structured.CLOSE):]
        self.call = None
        self.calls += 1
        self.after = True

    def _whole(self, block: str) -> list[dict]:
        """A block not written as the grammar writes calls: read whole, or text when unreadable."""
        _, calls = structured.parse_calls(block)
        if not calls:
            self.calls -= 1  # _close counts it; it was text
            return [{"content": block}]
        if self._repeated(block):
            self.calls -= 1
            return []
        fn = calls[0]["function"]
        index = self.calls
        return [{"tool_calls": [{"index": index, "id": structured.call_id(self.seed, index), "type": "function",
                                 "function": {"name": fn["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}]

    def _cut(self, args: str) -> str:
        """A call's arguments cut short: without the start of the template's closing text."""
        for k in range(len(self.TAIL), 0, -1):
            if args.endswith(self.TAIL[:k]):
                args = args[:-k]
                break
        args = args.rstrip()
        if args.endswith("}"):
            try:
                json.loads(args[:-1])
                return args[:-1].rstrip()  # the call object's own closing brace
            except ValueError:
                pass
        return args

    def flush(self) -> list[dict]:
        """At the end: the rest of a call cut short (by length) as its last fragment; other text as it is."""
        call = self.call
        out: list[dict] = []
        if call is not None and call["head"] is not None:
            args = self._cut(self.buf[len(structured.OPEN) + call["head"]:])
            if len(args) > call["sent"]:
                out.append({"tool_calls": [{"index": call["index"], "function": {"arguments": args[call["sent"]:]}}]})
        elif self.buf and not self.after and call is None:  # a call never begun in full is no text either
            out.append({"content": self.buf})
        self.buf, self.call = "", None
        return out
