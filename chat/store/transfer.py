"""Export formats out, and imports in: a JSON export or an OpenAI-style ``messages`` list."""
from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NoReturn

from .. import attachments as files
from .. import params as sampling
from ..errors import ProtocolError

MAX_IMPORT_MESSAGES = 5000
MAX_TITLE_CHARS = 200
MAX_ID_CHARS = 200
IMPORTED = " (imported)"
STATUSES = ("complete", "partial", "interrupted")
REASONS = ("stop", "length", "cancelled", "timeout", "shutdown", "error", "edited")
MAX_TIME = 253402300799  # 9999-12-31 23:59:59 UTC
MAX_FIGURES = 16
MAX_FIGURE = 10**15


def _iso(ts: float) -> str:
    """A UNIX time as a readable UTC date."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def filename(conv: dict, fmt: str) -> str:
    """The download name: an ASCII stem from the title, the id's start, the format."""
    ascii_title = unicodedata.normalize("NFKD", conv["title"]).encode("ascii", "ignore").decode()
    stem = re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")[:50].strip("-") or "conversation"
    return f"{stem}-{conv['id'][:8]}.{fmt}"


def markdown(conv: dict) -> str:
    """The conversation as a readable Markdown document."""
    parts = [f"# {conv['title']}", f"_Created {_iso(conv['created_at'])}_"]
    if conv["system"]:
        parts.append(f"**System:** {conv['system']}")
    for msg in conv["messages"]:
        parts.append(f"## {msg['role'].capitalize()}")
        if msg.get("reasoning"):  # a thinking model's thinking, quoted before its answer
            parts.append("> **Thinking:**\n" + "\n".join(f"> {line}" for line in msg["reasoning"].split("\n")))
        parts.append(files.with_attachments(msg["content"], msg.get("attachments")))
        if msg["role"] == "assistant" and msg["status"] != "complete":
            parts.append(f"_(incomplete answer: {msg['reason'] or msg['status']})_")
    return "\n\n".join(parts) + "\n"


def _bad(message: str) -> NoReturn:
    raise ProtocolError("bad_message", message)


def _text(value: object, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    _bad(f"{where}.content must be a string or a list of text parts")


def _optional(msg: dict, name: str, ok: Callable[[Any], bool], where: str) -> Any:
    """``msg[name]`` when absent/None or ``ok(value)``, else bad_message."""
    value = msg.get(name)
    if value is not None and not ok(value):
        _bad(f"{where}.{name} is not valid")
    return value


def _number(v: object) -> bool:
    """An int or a finite float, never a bool (an int of any size: callers compare it exactly)."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def _time(v: Any) -> bool:
    """A UNIX time from 1970 to the end of year 9999 (what a date can show)."""
    return _number(v) and 0 <= v <= MAX_TIME


def _figures(v: object) -> bool:
    """usage or timings: a few named numbers (or nulls) of a sane size."""
    return (isinstance(v, dict) and len(v) <= MAX_FIGURES and all(
        isinstance(k, str) and len(k) <= 64 and (x is None or (_number(x) and abs(x) <= MAX_FIGURE))
        for k, x in v.items()))


def _message(msg: Any, i: int, max_content_chars: int, where: str | None = None) -> dict:
    """One imported message, checked and reduced to the stored fields."""
    where = where or f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        _bad(f"{where} must be an object with role 'user' or 'assistant'")
    content = _text(msg.get("content", ""), where)
    attached = msg.get("attachments") or []
    problem = files.problem(attached)
    if problem:
        _bad(f"{where}.attachments {problem}")
    status = _optional(msg, "status", lambda v: v in STATUSES + ("streaming",), where) or "complete"
    if msg["role"] == "user":
        if len(content) + files.chars(attached) > max_content_chars:
            raise ProtocolError("too_large", f"{where} is longer than {max_content_chars} characters")
        status = "complete"
    created = _optional(msg, "created_at", _time, where)
    return {
        "role": msg["role"], "content": content, "attachments": files.clean(attached),
        # A message exported mid-answer is nobody's to finish here.
        "status": "interrupted" if status == "streaming" else status,
        "reason": _optional(msg, "reason", lambda v: v in REASONS, where),
        "usage": _optional(msg, "usage", _figures, where),
        "timings": _optional(msg, "timings", _figures, where),
        "created_at": created,
        # a thinking model's thinking (an answer's only)
        "reasoning": (_optional(msg, "reasoning", lambda v: isinstance(v, str), where) or None)
        if msg["role"] == "assistant" else None,
    }


# Control characters (NUL, CR/LF, ...) and the bidirectional overrides and isolates, which could make
# a title read backwards in the sidebar, a tab or a download name: never kept in a title.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u061c]")


def clean_title(title: str) -> str:
    """A title as stored: control and bidirectional-override characters out, whitespace collapsed."""
    return " ".join(_UNSAFE.sub(" ", title).split())


def imported_title(title: str, mark: str = IMPORTED) -> str:
    """The title of an imported copy (or a branch, ``mark`` " (branch)"): marked as one (once), within
    MAX_TITLE_CHARS."""
    title = clean_title(title)
    base = title[:-len(mark)] if title.endswith(mark) else title
    return base[:MAX_TITLE_CHARS - len(mark)].rstrip() + mark


def _tree(nodes: Any, max_content_chars: int, limit: int) -> tuple[list, dict]:
    """(messages, index of the active leaf) from an export's ``tree``: every version, each
    message after its parent (``parent_id`` null or an earlier ``id``)."""
    if not isinstance(nodes, list):
        _bad("'tree' must be a list")
    if len(nodes) > limit:
        raise ProtocolError("too_large", f"at most {limit} messages can be imported")
    index: dict = {}
    out = []
    for i, node in enumerate(nodes):
        where = f"tree[{i}]"
        msg = _message(node, i, max_content_chars, where)
        key, parent = node.get("id"), node.get("parent_id")
        if not isinstance(key, str) or not 0 < len(key) <= MAX_ID_CHARS or key in index:
            _bad(f"{where}.id must be a unique string of 1-{MAX_ID_CHARS} characters")
        if parent is not None and parent not in index:
            _bad(f"{where}.parent_id must be null or the id of a message before it")
        msg["parent"] = index[parent] if parent is not None else None
        index[key] = i
        out.append(msg)
    return out, index


def parse_import(body: Any, max_content_chars: int, max_messages: int = 0) -> dict:
    """{title, system, created_at, params, model, messages, active} from an import body (an export
    with its ``tree``, an older export's or an OpenAI-style ``messages`` list); each message names
    its ``parent`` by index, ``active`` is the index of the active leaf. ProtocolError when it is
    not one."""
    if not isinstance(body, dict) or not isinstance(body.get("messages", body.get("tree")), list):
        _bad("the body must be a JSON object with a 'messages' list")
    title = _optional(body, "title", lambda v: isinstance(v, str) and len(v.strip()) <= MAX_TITLE_CHARS, "body")
    system = _optional(body, "system", lambda v: isinstance(v, str), "body")
    created = _optional(body, "created_at", _time, "body")
    model = _optional(body, "model", lambda v: isinstance(v, str) and 0 < len(v) <= 200, "body")
    params = body.get("params") or {}
    problem = sampling.problem(params, where="body.params")
    if problem:
        _bad(problem)
    limit = min(MAX_IMPORT_MESSAGES, max_messages or MAX_IMPORT_MESSAGES)
    if system is not None and len(system) > max_content_chars:
        raise ProtocolError("too_large", f"the system prompt is longer than {max_content_chars} characters")
    if body.get("tree") is not None:
        messages, ids = _tree(body["tree"], max_content_chars, limit)
        active_id = body.get("active_id")
        if active_id is not None and active_id not in ids:
            _bad("active_id must be the id of a message in 'tree'")
        active = ids[active_id] if active_id is not None else len(messages) - 1
    else:
        raw = body["messages"]
        if raw and isinstance(raw[0], dict) and raw[0].get("role") == "system":
            if system is not None:
                _bad("a system prompt is given twice")
            system, raw = _text(raw[0].get("content", ""), "messages[0]"), raw[1:]
            if len(system) > max_content_chars:
                raise ProtocolError("too_large", f"the system prompt is longer than {max_content_chars} characters")
        if len(raw) > limit:
            raise ProtocolError("too_large", f"at most {limit} messages can be imported")
        offset = len(body["messages"]) - len(raw)
        messages = [_message(m, i + offset, max_content_chars) for i, m in enumerate(raw)]
        for i, msg in enumerate(messages):  # one path: each message's parent is the one before it
            msg["parent"] = i - 1 if i else None
        active = len(messages) - 1
    return {"title": title.strip() if title and title.strip() else None, "system": system or None,
            "created_at": created, "params": sampling.clean(params), "model": model,
            "messages": messages, "active": active if messages else None}
