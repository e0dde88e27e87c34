"""What the access log may show of a URL: never the API key, and the search words only when
CHAT_LOG_CONTENT allows message text in the logs.

Names are decoded before they are matched, as the app decodes them: ``?tok%65n=KEY`` reaches the
app as ``token`` and must not reach the log in clear.
"""
from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

REDACTED = "[redacted]"
SECRET = "token"  # ?token=<key> on /ws
SEARCH_PATH = "/api/search"
SEARCH_WORDS = "q"
_SEPARATORS = re.compile(r"([&;])")


def redact_query(query: str, path: str = "", log_content: bool = False) -> str:
    """``query`` with the value of every ``token`` (and on the search path of every ``q``, unless
    ``log_content``) replaced by [redacted], however the name is encoded."""
    search = not log_content and re.sub("/+", "/", unquote(path)).rstrip("/").endswith(SEARCH_PATH)
    parts = _SEPARATORS.split(query)
    for i in range(0, len(parts), 2):
        name, eq, _ = parts[i].partition("=")
        decoded = unquote_plus(name).strip().lower()
        if decoded == SECRET or (search and decoded == SEARCH_WORDS):
            parts[i] = f"{name}={REDACTED}"
    return "".join(parts)


def redact_uri(uri: str, log_content: bool = False) -> str:
    """A request target (path?query, or an absolute URL) with its query redacted."""
    path, sep, query = uri.partition("?")
    if not sep:
        return uri
    query, hash_sign, fragment = query.partition("#")
    return f"{path}?{redact_query(query, path, log_content)}{hash_sign}{fragment}"


def redact_request_line(line: str, log_content: bool = False) -> str:
    """``METHOD target PROTOCOL`` with its target redacted."""
    method, space, rest = line.partition(" ")
    target, space2, protocol = rest.rpartition(" ")
    if not space or not space2:
        return redact_uri(line, log_content)
    return f"{method} {redact_uri(target, log_content)} {protocol}"
