"""Text files attached to a user message: their limits, and how the model sees them."""
from __future__ import annotations

import re

MAX_ATTACHMENTS = 8
MAX_NAME_CHARS = 200
_FENCE = re.compile(r"`{3,}")


def problem(value: object) -> str | None:
    """Why ``value`` is not a valid attachments list (None when it is)."""
    if not isinstance(value, list):
        return "must be a list"
    if len(value) > MAX_ATTACHMENTS:
        return f"may hold at most {MAX_ATTACHMENTS} files"
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            return "items must be objects with a string 'text'"
        name = item.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or not name.strip():
            return f"items need a 'name' of 1-{MAX_NAME_CHARS} characters"
    return None


def clean(value: list[dict] | None) -> list[dict]:
    """Only the fields that are kept: name and text."""
    return [{"name": a["name"], "text": a["text"]} for a in value or []]


def chars(attachments: list[dict] | None) -> int:
    """Characters of attachment text, counted against ``max_content_chars``."""
    return sum(len(a["text"]) for a in attachments or [])


def with_attachments(content: str, attachments: list[dict] | None) -> str:
    """The text the model sees: the message, then each file as a fenced block under its name."""
    parts = [content]
    for a in attachments or []:
        # A fence longer than any backtick run inside keeps the file from closing it early.
        longest = max((len(m) for m in _FENCE.findall(a["text"])), default=2)
        fence = "`" * max(3, longest + 1)
        parts.append(f"{a['name']}:\n{fence}\n{a['text']}\n{fence}")
    return "\n\n".join(parts)
