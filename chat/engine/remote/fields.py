"""What the remote engine passes to an OpenAI-compatible upstream beyond plain chat, and what it reads
back: ``response_format``, ``tools``/``tool_choice``/``parallel_tool_calls``, ``logprobs``/
``top_logprobs`` and, for a raw prompt, ``/completions`` with ``echo``; the upstream's tool calls,
reasoning and log probabilities as this server's own events.

Tool calls come back as the text the local engine writes for them (``<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>``, see ``chat/structured.py``): the web layer reads them out of the
answer's text whichever engine made it, so ``/v1`` and the WebSocket answer alike in front of either.
"""
from __future__ import annotations

import json
from typing import Any

from ... import structured
from ..base import GenParams
from ..events import Delta, Splitter

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "}\n</tool_call>"


def messages(given: list, p: GenParams) -> list:
    """The messages upstream: as the turn has them, or a history with tool calls and results as the client
    wrote it (after the server's system prompt, when the turn added one)."""
    plain = [{"role": m["role"], "content": m["content"],
              **({"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {})}
             for m in given]
    native = p.upstream.get("messages")
    if not native:
        return plain
    own = any(m.get("role") in ("system", "developer") for m in native)
    return [m for m in plain[:1] if m["role"] == "system" and not own] + list(native)


def chat_fields(p: GenParams) -> dict:
    """The structured fields of a chat request, as the upstream takes them."""
    out = {k: v for k, v in p.upstream.items() if k != "messages"}
    if p.enable_thinking is not None:  # as vLLM, SGLang and llama.cpp's server take it
        out["chat_template_kwargs"] = {"enable_thinking": p.enable_thinking}
    if p.logprobs is not None:
        out["logprobs"] = True
        if p.logprobs:
            out["top_logprobs"] = p.logprobs
    return out


def forced(p: GenParams) -> frozenset[str]:
    """The functions the request's tool choice obliges the answer to call (``structured.forced_names``)."""
    return structured.forced_names(p.upstream.get("tool_choice"), list(p.upstream.get("tools") or ()))


def completion_body(p: GenParams, model: str, prompt: str) -> dict:
    """A ``/completions`` request for a raw prompt (its ``echo`` and ``logprobs`` too)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True, "max_tokens": p.max_new_tokens,
                            "temperature": p.temperature, "top_p": p.top_p}
    top = p.logprobs if p.logprobs is not None else p.prompt_logprobs
    if top is not None:
        body["logprobs"] = top
    if p.prompt_logprobs is not None:
        body["echo"] = True
    return body


def _entry(token: str, logprob: Any, top: dict | None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass")),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "surrogatepass"))}
                             for t, v in (top or {}).items()]}


class Relay:
    """One upstream answer's choices in, this server's ``Delta`` events out.

    ``forced``: the functions a named or ``required`` tool choice obliges the answer to call. An upstream
    that answers such a choice with the call written as text (llama.cpp's server, for a template whose
    call format it does not read) has that text held until the answer ends and read as the call
    (``structured.written_call``); one that sends ``tool_calls`` is relayed as they come."""

    def __init__(self, echo: str | None = None, forced: frozenset[str] = frozenset()) -> None:
        self.forced = forced
        self.text: list[Delta] = []  # forced: the answer's text (and its log probabilities) held until it ends
        self.call: int | None = None  # the index of the tool call being written
        self.echo: str | None = echo  # a raw prompt echoed back: its text and log probabilities come first
        self.prompt_len = len(echo or "")
        self.prompt_entries: list[dict] = []
        # an upstream that leaves a thinking model's <think> block in the content (llama.cpp's server with
        # --reasoning-format none): split here as the local engine splits it
        self.thinking = Splitter()

    def chat(self, choice: dict) -> list[Delta]:
        """A ``chat.completion.chunk`` choice: its text, reasoning, tool calls and log probabilities."""
        delta = choice.get("delta") or {}
        out: list[Delta] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.append(Delta("", reasoning=reasoning))
        content = delta.get("content")
        thought, text = self.thinking.push(content) if isinstance(content, str) and content else ("", "")
        if thought:
            out.append(Delta("", reasoning=thought))
        if text and self.call is not None:
            text = self._close() + text
        calls = delta.get("tool_calls") or ()
        if calls and self.forced:  # the upstream writes calls itself: what it held is text before them
            self.forced = frozenset()
            out += self.text
            self.text = []
        for call in calls:
            text += self._call(call)
        entries = tuple((choice.get("logprobs") or {}).get("content") or ())
        if text or entries:
            (self.text if self.forced else out).append(Delta(text, entries))
        return out

    def _call(self, call: dict) -> str:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        text = ""
        if index != self.call:
            if self.call is not None:
                text += self._close() + "\n"
            self.call = index
            text += f'{CALL_OPEN}{{"name": {json.dumps(fn.get("name") or "")}, "arguments": '
        args = fn.get("arguments")
        return text + (args if isinstance(args, str) else "")

    def _close(self) -> str:
        self.call = None
        return CALL_CLOSE

    def end(self) -> list[Delta]:
        """The answer ended: thinking or text still held comes out (a forced call written as text read as
        the call), a call still open is closed."""
        thought, text = self.thinking.flush()
        out = [Delta("", reasoning=thought)] if thought else []
        held, self.text = self.text + ([Delta(text)] if text else []), []
        call = structured.written_call("".join(d.text for d in held), self.forced) if self.forced else None
        if call is not None:
            out.append(Delta(call, tuple(e for d in held for e in d.logprobs)))
        else:
            out += held
        return out + ([Delta(self._close())] if self.call is not None else [])

    def held(self) -> list[Delta]:
        """Thinking or text the split still holds (a tag that may have been coming), however the answer ended."""
        thought, text = self.thinking.flush()
        held = [Delta(text, reasoning=thought)] if thought or text else []
        if self.forced:  # the text held for a forced call: never read as one when the answer is cut short
            held, self.text = self.text + held, []
        return held

    def legacy(self, choice: dict) -> list[Delta]:
        """A ``text_completion`` choice: its text; with ``echo``, the prompt's part split off as the
        prompt's log probabilities (the legacy shape turned into entries)."""
        given = choice.get("text")
        text: str = given if isinstance(given, str) else ""
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or [None] * len(tokens)
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        entries = [_entry(t, v, top) for t, v, top in zip(tokens, values, tops)]
        out: list[Delta] = []
        if self.echo is not None:
            # the prompt's text comes back first (in one or more chunks): not part of the answer
            cut = min(len(self.echo), len(text))
            self.echo, text = self.echo[cut:], text[cut:]
            offsets = lp.get("text_offset") or []
            taken = sum(1 for offset in offsets if isinstance(offset, int) and offset < self.prompt_len)
            self.prompt_entries += entries[:taken]
            entries = entries[taken:]
            if not self.echo:
                self.echo = None
                out.append(Delta("", prompt_logprobs=tuple(self.prompt_entries)))
        if text or entries:
            out.append(Delta(text, tuple(entries)))
        return out
