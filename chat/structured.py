"""Structured answers: ``response_format`` and ``tools`` checked and turned into a grammar the engine
constrains decoding with (llguidance's JSON-schema and Lark formats), and tool calls read back out
of the answer's text. No torch here; the engine compiles the grammar (``engine/core/grammar.py``).

Tool calls use Qwen2.5's own text format, whichever model answers: ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, one block per call. A history's tool calls and tool results are
written back in the same format (results as ``<tool_response>`` user turns), which is what Qwen's
template renders too; a template without tools gets a generic system prompt (``tools_prompt``).
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

import llguidance

from .errors import RequestError

MAX_SCHEMA_BYTES = 32 * 1024  # one schema (or all tools' schemas together), as JSON
MAX_DEPTH = 16  # nesting of a schema's objects and arrays
MAX_TOOLS = 32
MAX_DESCRIPTION_CHARS = 4096  # one tool's description
MAX_TOOLS_CHARS = 64 * 1024  # all tools' names, descriptions and parameters together, as JSON
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
HEAD = re.compile(r'\s*\{"name":\s*"([A-Za-z0-9_-]*)",\s*"arguments":\s*(?=\S)')  # how the grammar writes a call


def _bad(name: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(code, f"'{name}' {message}", 400, name)


def _depth(value: Any, limit: int, name: str, level: int = 0) -> None:
    if level > limit:
        raise _bad(name, f"nests deeper than {limit} levels", "schema_too_large")
    if isinstance(value, dict):
        for v in value.values():
            _depth(v, limit, name, level + 1)
    elif isinstance(value, list):
        for v in value:
            _depth(v, limit, name, level + 1)


def check_schema(schema: Any, name: str) -> dict:
    """``schema`` when it is a JSON schema within the limits llguidance accepts; a 400 otherwise."""
    if not isinstance(schema, dict):
        raise _bad(name, "must be a JSON schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise _bad(name, f"is larger than {MAX_SCHEMA_BYTES} bytes", "schema_too_large")
    _depth(schema, MAX_DEPTH, name)
    problem = llguidance.LLMatcher.validate_grammar(schema_grammar(schema))
    if problem:
        raise _bad(name, f"is not a schema this server can enforce: {problem}", "invalid_schema")
    return schema


# JSON written as people write it ({"a": 1, "b": [2, 3]}), with no other whitespace: a small model
# left free to add whitespace can fill its whole answer with it.
JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_grammar(schema: dict) -> str:
    """The llguidance grammar of JSON that validates against ``schema`` (written in JSON_STYLE)."""
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_STYLE)


def response_format(value: Any, name: str = "response_format") -> str | None:
    """The grammar a ``response_format`` asks for (None: plain text)."""
    if not isinstance(value, dict):
        raise _bad(name, "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(f"{name}.json_schema", "must be an object with a 'schema'")
        if spec.get("name") is not None and not (isinstance(spec["name"], str) and _NAME.match(spec["name"])):
            raise _bad(f"{name}.json_schema.name", "must be 1-64 letters, digits, '_' or '-'")
        schema = spec.get("schema", {"type": "object"})
        return schema_grammar(check_schema(schema, f"{name}.json_schema.schema"))
    raise _bad(f"{name}.type", f"must be text, json_object or json_schema, not {kind!r}")


def tools(value: Any, name: str = "tools") -> list[dict]:
    """The ``tools`` list, checked: function tools with a name and a parameters schema."""
    if not isinstance(value, list):
        raise _bad(name, "must be a list")
    if len(value) > MAX_TOOLS:
        raise _bad(name, f"holds more than {MAX_TOOLS} tools", "too_many_tools")
    # Counted before anything is checked or rendered: the tools become part of the prompt.
    if len(json.dumps(value)) > MAX_TOOLS_CHARS:
        raise _bad(name, f"hold more than {MAX_TOOLS_CHARS} characters as JSON (names, descriptions and "
                         "parameters together)", "tools_too_large")
    out, seen, size = [], set(), 0
    for i, tool in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(where, "must be {\"type\": \"function\", \"function\": {...}}")
        fn = tool["function"]
        fname = fn.get("name")
        if not isinstance(fname, str) or not _NAME.match(fname):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
        if fname in seen:
            raise _bad(f"{where}.function.name", f"repeats {fname!r}")
        seen.add(fname)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description", "must be a string")
        if desc is not None and len(desc) > MAX_DESCRIPTION_CHARS:
            raise _bad(f"{where}.function.description", f"is longer than {MAX_DESCRIPTION_CHARS} characters",
                       "tools_too_large")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"{where}.function.parameters")
        size += len(json.dumps(params))
        if size > MAX_SCHEMA_BYTES:
            raise _bad(name, f"hold more than {MAX_SCHEMA_BYTES} bytes of schemas", "schema_too_large")
        out.append({"type": "function", "function": {"name": fname, "description": desc or "",
                                                     "parameters": params}})
    return out


def tool_choice(value: Any, listed: list[dict], name: str = "tool_choice") -> str:
    """``auto``, ``none``, ``required`` or the name of the one function to call."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        wanted = value["function"].get("name")
        if wanted not in {t["function"]["name"] for t in listed}:
            raise _bad(f"{name}.function.name", f"names no tool in 'tools': {wanted!r}")
        return str(wanted)
    raise _bad(name, "must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")


def tools_grammar(listed: list[dict], choice: str, parallel: bool) -> str | None:
    """The grammar of an answer under ``choice``: tool calls only (``required``, a name), or free text
    that does not start with ``<`` or tool calls (``auto``); None for ``none``. One call, except with
    ``parallel`` under ``auto`` or ``required`` (a named choice is one call of that function)."""
    if choice == "none" or not listed:
        return None
    chosen = [t for t in listed if choice in ("auto", "required") or t["function"]["name"] == choice]
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False} for t in chosen],
        "x-guidance": JSON_STYLE}
    calls = 'calls: call ("\\n" call)*' if parallel and choice in ("auto", "required") else "calls: call"
    start = "start: TEXT | calls" if choice == "auto" else "start: calls"
    lark = "\n".join([start, "TEXT: /[^<][\\s\\S]*/", calls,
                      'call: "<tool_call>\\n" body "\\n</tool_call>"',
                      f"body: %json {json.dumps(call)}"])
    return llguidance.grammar_from("lark", lark)


def tools_prompt(listed: list[dict]) -> str:
    """The generic system prompt for a chat template that does not render tools itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in listed)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_id(seed: str | None, index: int) -> str:
    """A tool call's id: from the answer's own id and the call's index, so the streamed and the whole
    form of one answer (and its stored copy, read again) name each call alike; random without a seed."""
    if seed is None:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{seed}:{index}'.encode()).hexdigest()[:24]}"


def parse_calls(text: str, seed: str | None = None) -> tuple[str, list[dict]]:
    """(text outside the calls, OpenAI ``tool_calls``) of an answer; unreadable blocks stay text, and a
    call identical to an earlier one is dropped (a small model can loop on one call)."""
    calls: list[dict] = []
    kept, last, seen = [], 0, set()
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        same = json.dumps(body, sort_keys=True)
        if same in seen:
            continue
        seen.add(same)
        calls.append({"id": call_id(seed, len(calls)), "type": "function",
                      "function": {"name": body["name"], "arguments": raw_arguments(match.group(1), body)}})
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def forced_names(choice: Any, listed: list[dict]) -> frozenset[str]:
    """The functions a ``tool_choice`` obliges the answer to call (a named one, or any listed one for
    ``required``); empty when the answer may be text."""
    if isinstance(choice, dict):
        return frozenset([((choice.get("function") or {}).get("name")) or ""])
    if choice == "required":
        return frozenset(t["function"]["name"] for t in listed)
    return frozenset()


_FENCE = re.compile(r"\s*```(?:json)?\s*")


def written_call(text: str, names: frozenset[str]) -> str | None:
    """A call an upstream wrote as text (``{"name": ..., "arguments": {...}}``, bare or in a fenced block,
    as llama.cpp's server answers a forced choice when it does not read the model's own call format), in
    this server's call format, with any text after it; None when the text does not start with a call to
    one of ``names``."""
    fence = _FENCE.match(text)
    body = text[fence.end():] if fence else text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)):
        return None
    rest = body[end:].strip()
    if fence and rest.startswith("```"):
        rest = rest[3:].strip()
    call = json.dumps({"name": value["name"], "arguments": value["arguments"]}, ensure_ascii=False)
    return f"{OPEN}\n{call}\n{CLOSE}" + (f"\n{rest}" if rest else "")


def raw_arguments(text: str, body: dict) -> str:
    """A call's arguments as the model wrote them (what streaming sent), else re-serialized."""
    head = HEAD.match(text)
    if head:
        raw = text[head.end():].rstrip()[:-1].rstrip()  # without the call object's closing brace
        try:
            if json.loads(raw) == body.get("arguments"):
                return raw
        except ValueError:
            pass
    return json.dumps(body.get("arguments", {}), ensure_ascii=False)


def history(messages: list, name: str = "messages") -> list:
    """A history's tool calls and tool results as text turns in the tool-call format (see above);
    other messages unchanged."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "tool":
            content = m.get("content")
            if isinstance(content, list):
                texts = [p.get("text", "") for p in content if isinstance(p, dict)]
                content = "".join(texts) if all(isinstance(t, str) for t in texts) else None
            if not isinstance(content, str):
                raise _bad(f"{name}[{i}].content", "must be a string")
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = []
            for j, call in enumerate(m["tool_calls"] if isinstance(m["tool_calls"], list) else [None]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{name}[{i}].tool_calls[{j}]", "must have a function with a name")
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError, RecursionError):
                    raise _bad(f"{name}[{i}].tool_calls[{j}].function.arguments", "must be a JSON string") from None
                blocks.append(f"{OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args}, ensure_ascii=False)}"
                              f"\n{CLOSE}")
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)})
        else:
            out.append(m)
    return out
