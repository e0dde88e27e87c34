"""Export formats out, and imports in: a JSON export or an OpenAI-style ``messages`` list."""
from __future__ import annotations

from typing import NoReturn

import math
import re
import unicodedata
from datetime import datetime, timezone

from .. import attachments as files
from ..errors import ProtocolError

MAX_IMPORT_MESSAGES = 5000
MAX_TITLE_CHARS = 200
STATUSES = ("complete", "partial", "interrupted")
REASONS = ("stop", "length", "cancelled", "timeout", "shutdown", "error")


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
        parts += [f"## {msg['role'].capitalize()}", files.with_attachments(msg["content"], msg.get("attachments"))]
        if msg["role"] == "assistant" and msg["status"] != "complete":
            parts.append(f"_(incomplete answer: {msg['reason'] or msg['status']})_")
    return "\n\n".join(parts) + "\n"


def _bad(message: str) -> NoReturn:
    raise ProtocolError("bad_message", message)


def _text(value, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    _bad(f"{where}.content must be a string or a list of text parts")


def _optional(msg: dict, name: str, ok, where: str):
    """``msg[name]`` when absent/None or ``ok(value)``, else bad_message."""
    value = msg.get(name)
    if value is not None and not ok(value):
        _bad(f"{where}.{name} is not valid")
    return value


def _message(msg, i: int, max_content_chars: int) -> dict:
    """One imported message, checked and reduced to the stored fields."""
    where = f"messages[{i}]"
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
    created = _optional(msg, "created_at", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) and v >= 0, where)
    return {
        "role": msg["role"], "content": content, "attachments": files.clean(attached),
        # A message exported mid-answer is nobody's to finish here.
        "status": "interrupted" if status == "streaming" else status,
        "reason": _optional(msg, "reason", lambda v: v in REASONS, where),
        "usage": _optional(msg, "usage", lambda v: isinstance(v, dict), where),
        "timings": _optional(msg, "timings", lambda v: isinstance(v, dict), where),
        "created_at": created,
    }


def parse_import(body, max_content_chars: int, max_messages: int = 0) -> dict:
    """{title, system, created_at, messages} from an import body; ProtocolError when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        _bad("the body must be a JSON object with a 'messages' list")
    title = _optional(body, "title", lambda v: isinstance(v, str) and len(v.strip()) <= MAX_TITLE_CHARS, "body")
    system = _optional(body, "system", lambda v: isinstance(v, str), "body")
    created = _optional(body, "created_at", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) and v >= 0, "body")
    raw = body["messages"]
    if raw and isinstance(raw[0], dict) and raw[0].get("role") == "system":
        if system is not None:
            _bad("a system prompt is given twice")
        system, raw = _text(raw[0].get("content", ""), "messages[0]"), raw[1:]
    limit = min(MAX_IMPORT_MESSAGES, max_messages or MAX_IMPORT_MESSAGES)
    if len(raw) > limit:
        raise ProtocolError("too_large", f"at most {limit} messages can be imported")
    if system is not None and len(system) > max_content_chars:
        raise ProtocolError("too_large", f"the system prompt is longer than {max_content_chars} characters")
    offset = len(body["messages"]) - len(raw)
    return {"title": title.strip() if title and title.strip() else None, "system": system or None,
            "created_at": created,
            "messages": [_message(m, i + offset, max_content_chars) for i, m in enumerate(raw)]}
