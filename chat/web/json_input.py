"""JSON from clients, checked for text that is not Unicode: a lone surrogate (``"\\ud800"``) is valid
JSON but no character, and fails later where text is encoded (a frame, the database, a log line).

Every JSON body and frame a client sends goes through ``loads``, so each transport refuses such
text at its edge with its own "bad request" (``bad_message``; ``invalid_json`` on ``/v1``).
"""
from __future__ import annotations

import json
import re
from typing import Any

# Only an escape can put a surrogate into decoded JSON (the text itself is decoded UTF-8, which
# holds none), so documents without one skip the walk.
_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class NotText(ValueError):
    """A string in the JSON holds a lone surrogate."""

    def __init__(self) -> None:
        super().__init__("text must be valid Unicode: a lone surrogate (\\ud800-\\udfff) is not a character")


def loads(raw: str | bytes | bytearray) -> Any:
    """``json.loads(raw)``; NotText when any string in it (a key too) holds a lone surrogate."""
    value = json.loads(raw)
    escapes = _ESCAPE_BYTES if isinstance(raw, (bytes, bytearray)) else _ESCAPE
    if escapes.search(raw) is not None and has_lone_surrogate(value):  # type: ignore[arg-type]
        raise NotText()
    return value


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string in ``value`` (nested lists and objects, keys included) holds a surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
