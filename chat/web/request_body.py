"""Request bodies read whole before the app runs, within a time bound (WSGI middleware).

gunicorn's gevent worker waits for a body as long as the client likes: a client that declares
100 kB and sends one byte holds a connection, and its greenlet, for ever, and a few dozen of them
use up ``worker_connections``. Here a body must keep arriving (no silence longer than
CHAT_BODY_TIMEOUT_S) and arrive whole within CHAT_BODY_TIMEOUT_S plus one second per MIN_RATE
bytes; otherwise the request is answered 408 and the connection closed. Behind nginx (which reads
the whole body before passing it on) the bound never bites.

Every path has a largest body (``limit``): a declared length over it is answered 413 at once, before
a byte of the body is read, and a chunked body is read only up to it. So no route ever parses more
than its own bound, whatever the method.
"""
from __future__ import annotations

import io
import json
import socket
import time
from typing import Any, Callable, Iterable, Iterator

from ..concurrency import gevent_active

MAX_BODY_BYTES = 16 * 2**20  # the largest body a route takes (/v1)
MAX_IMPORT_BYTES = 2 * 2**20  # an import (the same cap as nginx's client_max_body_size)
API_SLACK = 64 * 1024  # room for an /api body's other fields, past its longest text
ESCAPED = 6  # bytes one character may take in JSON (``\u0000``)
MIN_RATE = 16 * 1024  # bytes a second a long body must average, past the first timeout
CHUNK = 64 * 1024


class BodyTimeout(Exception):
    """The body stopped arriving, or arrives too slowly."""


class BoundedBody:
    """WSGI middleware: see the module doc."""

    def __init__(self, app: Callable, timeout_s: float, max_content_chars: int = 16000,
                 max_document_bytes: int = 10 * 2**20) -> None:
        self.app, self.timeout_s = app, timeout_s
        self.document_bytes = max_document_bytes  # /api/documents: a file as the body (CHAT_MAX_DOCUMENT_MB)
        # The longest /api text field (a system prompt) escaped as JSON, plus the other fields.
        self.api_bytes = ESCAPED * max_content_chars + API_SLACK

    def limit(self, path: str) -> int:
        """The largest body ``path`` takes: /v1's requests, an import, a document, or any other route's fields."""
        if path.startswith("/v1/"):
            return MAX_BODY_BYTES
        if path == "/api/conversations/import":
            return MAX_IMPORT_BYTES
        if path == "/api/documents":
            return self.document_bytes
        return min(self.api_bytes, MAX_BODY_BYTES)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        try:
            declared = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        limit = self.limit(environ.get("PATH_INFO", ""))
        if declared > limit and not chunked:
            return self._refuse(environ, start_response, 413, "too_large",
                                f"the request body is too large (at most {limit} bytes here)")
        if not (chunked or declared > 0):
            return self.app(environ, start_response)
        try:
            body = self._read(environ["wsgi.input"], declared if not chunked else None, limit)
        except BodyTimeout:
            return self._refuse(environ, start_response, 408, "request_timeout",
                                f"the request body did not arrive in time (at most {self.timeout_s:g} s of silence)")
        if body is None:
            return self._refuse(environ, start_response, 413, "too_large",
                                f"the request body is too large (at most {limit} bytes here)")
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        environ["wsgi.input_terminated"] = False
        return self.app(environ, start_response)

    def _read(self, stream: Any, length: int | None, most: int) -> bytes | None:
        """The body (``length`` bytes, or up to its end when chunked); None when a chunked body
        passes ``most``. Without a timeout (CHAT_BODY_TIMEOUT_S=0) it waits as long as it takes."""
        limit = most if length is None else length
        deadline = time.monotonic() + self.timeout_s + limit / MIN_RATE
        wanted = limit + 1 if length is None else limit  # a chunked body: one byte more tells it is too long
        parts, got = [], 0
        while got < wanted:
            wait = min(self.timeout_s, deadline - time.monotonic())
            if self.timeout_s and wait <= 0:
                raise BodyTimeout()
            with _within(wait if self.timeout_s else None):
                data = stream.read(min(CHUNK, wanted - got))
            if not data:
                break
            parts.append(data)
            got += len(data)
        if length is None and got > limit:
            return None
        return b"".join(parts)

    @staticmethod
    def _refuse(environ: dict, start_response: Callable, status: int, code: str, message: str) -> Iterable[bytes]:
        """A JSON error (OpenAI's shape on /v1), then the connection is closed."""
        error: dict = {"code": code, "message": message}
        if environ.get("PATH_INFO", "").startswith("/v1"):
            error.update(type="invalid_request_error", param=None)
        body = json.dumps({"error": error}).encode()
        reason = "Request Timeout" if status == 408 else "Content Too Large"
        start_response(f"{status} {reason}", [("Content-Type", "application/json"),
                                              ("Content-Length", str(len(body)))])
        return _ThenClose([body], environ.get("gunicorn.socket"))


class _ThenClose:
    """A response body that shuts its connection down once written (gunicorn keeps a connection
    whose request body was not read for the next request, and would wait on that body again)."""

    def __init__(self, chunks: list[bytes], sock: Any) -> None:
        self.chunks, self.sock = chunks, sock

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.chunks)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _within:
    """Raise BodyTimeout in the block after ``seconds`` (under gevent; without it, no bound)."""

    def __init__(self, seconds: float | None) -> None:
        self.timer: Any = None
        if seconds is not None and gevent_active():
            import gevent
            self.timer = gevent.Timeout(seconds, BodyTimeout)

    def __enter__(self) -> None:
        if self.timer is not None:
            self.timer.start()

    def __exit__(self, *exc: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
