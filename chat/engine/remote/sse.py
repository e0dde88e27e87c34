"""The body of a streamed HTTP response (server-sent events), as lines, read straight off the socket.

http.client reads the status line and headers; its chunked body reader costs several Python
calls and a buffered read per chunk, and a streaming upstream sends one chunk per token. Here
the chunked framing (or a plain body, up to its length or the connection's end) is undone in
one pass over whatever one ``recv`` returned, and the payload split into lines.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

READ_BYTES = 65536
MAX_LINE_BYTES = 1 << 20
MAX_SIZE_LINE = 1024  # a chunk-size line, extensions included


class Body:
    """Lines of ``response``'s body; ``recv(n)`` reads the connection (see ``concurrency.receiver``)."""

    def __init__(self, response: Any, recv: Callable[[int], bytes]) -> None:
        self._fp = response.fp  # what http.client has buffered past the headers is read from it first
        self._recv = recv
        self._chunked = bool(response.chunked)
        self._left = None if self._chunked else response.length  # None: until the connection closes
        self._raw = bytearray()  # chunked: received bytes not yet decoded
        self._need = 0  # chunked: payload bytes still to come in the current chunk
        self._crlf = False  # chunked: the CRLF closing a chunk's payload is next
        self._pending = b""  # the start of a line whose end has not arrived
        self.ended = self._left == 0

    def read(self) -> list[bytes] | None:
        """The lines completed by the next arrival (possibly none); None once the body has ended."""
        if self.ended:
            return None
        if self._fp is not None:  # read1 returns every buffered byte (at most the buffer's size)
            data, self._fp = self._fp.read1(READ_BYTES), None
        else:
            data = self._recv(READ_BYTES)
        if not data:
            self.ended = True
            return None
        if self._chunked:
            data = self._dechunk(data)
        elif self._left is not None:
            data = data[:self._left]
            self._left -= len(data)
            self.ended = self._left == 0
        lines = (self._pending + data).split(b"\n") if self._pending else data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > MAX_LINE_BYTES:
            raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
        if self.ended and self._pending:
            lines.append(self._pending)
            self._pending = b""
        return lines

    def _dechunk(self, data: bytes) -> bytes:
        """The payload in ``data`` and what was held back; sets ``ended`` at the last chunk."""
        raw = self._raw
        raw += data
        out = bytearray()
        pos, size = 0, len(raw)
        while pos < size:
            if self._need:
                take = min(self._need, size - pos)
                out += raw[pos:pos + take]
                pos += take
                self._need -= take
                self._crlf = self._need == 0
            elif self._crlf:
                if size - pos < 2:
                    break
                if raw[pos:pos + 2] != b"\r\n":
                    raise ValueError("malformed chunked body: no CRLF after a chunk")
                pos += 2
                self._crlf = False
            else:
                end = raw.find(b"\r\n", pos, pos + MAX_SIZE_LINE)
                if end < 0:
                    if size - pos >= MAX_SIZE_LINE:
                        raise ValueError("malformed chunked body: no chunk size")
                    break
                try:
                    self._need = int(raw[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    raise ValueError(f"malformed chunked body: chunk size {bytes(raw[pos:end][:40])!r}") from None
                if self._need < 0:
                    raise ValueError(f"malformed chunked body: chunk size {self._need}")
                pos = end + 2
                if self._need == 0:  # the last chunk (its trailers, if any, are not read)
                    self.ended = True
                    break
        del raw[:pos]
        return bytes(out)
