"""simple-websocket's Server with bounded input, and flask-sock's route that serves it.

simple-websocket reads a connection on a background greenlet into an unbounded list, answers every
control ping at once, and writes with a plain ``send``. A client that sends without reading could
then grow the worker's memory without limit (frames pile up while the session waits to write), hold
the reader in a write for ever (pongs nobody reads), or flood it with pings. Here:

- at most ``max_unread`` bytes of whole messages wait for the session; then the socket is not read
  until the session takes some (TCP pushes back on the client). A session that takes nothing for
  ``send_timeout`` (it is stuck writing to this same client) loses the connection;
- every write (pongs, the server's pings, closes, the session's frames) is whole (``sendall``),
  one at a time (``write_lock``, which the session's own frames take too), and bounded by
  ``send_timeout``: a client that does not read what it is sent is cut;
- control pings are answered at most MAX_PINGS at once, PINGS_PER_S a second after that; more
  close the connection with 1008 (policy violation);
- one message may come in at most MAX_FRAGMENTS frames, within MESSAGE_S seconds of its first: an
  endless run of empty continuation frames closes the connection with 1008 instead of spinning;
- a close the server starts (a message too big, a policy violation) lingers: what the client still
  sends is read and thrown away, up to LINGER_BYTES for LINGER_S, so the close frame reaches it
  instead of being destroyed by the reset the kernel sends for unread data.

The reader replaces simple-websocket's private loop: that loop is ``internals.ReaderLoop`` (with every
other private part the transport leans on); the bounds it keeps are here. The version is bounded in
requirements.txt.
"""
from __future__ import annotations

import socket
import threading
import time
from functools import wraps
from typing import Any, Callable

from flask import Response, current_app, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed
from wsproto.events import BytesMessage, CloseConnection, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from ..limits import TokenBucket
from . import backpressure
from .internals import ReaderLoop

MAX_PINGS = 32  # control pings answered in a burst
PINGS_PER_S = 2.0  # and after it
MAX_FRAGMENTS = 1024  # frames of one message (browsers send one; a client that fragments, a few)
MESSAGE_S = 30.0  # from a message's first frame to its last
LINGER_S = 5.0  # how long a closed connection's input is drained, at most
LINGER_BYTES = 16 * 2**20  # and how much of it


class BoundedServer(ReaderLoop):
    """A server-side WebSocket whose reader and writers are bounded (see the module doc)."""

    def __init__(self, environ: dict, max_unread: int = 2**20, send_timeout: float = 30.0, **options: Any) -> None:
        self.max_unread, self.send_timeout = max_unread, send_timeout
        # One writer at a time, so frames never interleave; reentrant: the session holds it around send()
        self.write_lock = threading.RLock()
        self.unread = 0  # bytes of whole messages in input_buffer
        self.room = threading.Event()  # set when the session takes a message
        self.pings = TokenBucket(MAX_PINGS, PINGS_PER_S)
        self.fragments = 0  # frames of the message being received
        self.message_started = 0.0  # when its first frame came
        self.close_sent = self.peer_closed = False  # which side's close frame went out (see _linger)
        super().__init__(environ, **options)

    # ---- the session's side

    def receive(self, timeout: float | None = None) -> Any:
        """The next whole message (as simple-websocket's), making room for the reader."""
        data = super().receive(timeout)
        if data is not None:
            self.unread -= len(data)
            self.room.set()
        return data

    def send(self, data: Any) -> None:
        """Send one message, whole, within the send timeout (SendTimeout: the client stopped reading)."""
        if not self.connected:
            raise ConnectionClosed(self.close_reason, self.close_message)
        event = BytesMessage(data=data) if isinstance(data, bytes) else TextMessage(data=str(data))
        self.write(self.ws.send(event))

    def close(self, reason: int | None = None, message: str | None = None) -> None:
        """Send a close frame (within the send timeout) and stop."""
        if not self.connected:
            raise ConnectionClosed(self.close_reason, self.close_message)
        self.connected = False
        try:
            self.write(self.ws.send(CloseConnection(reason or CloseReason.NORMAL_CLOSURE, message)))
            self.close_sent = True
        except (OSError, backpressure.SendTimeout, LocalProtocolError):
            backpressure.cut(self)

    def write(self, data: bytes) -> None:
        """Write ``data`` whole, as the only writer, within the send timeout."""
        if not data:
            return
        with backpressure.within(self.send_timeout), self.write_lock:
            self.sock.sendall(data)

    # ---- the reader's bounds (its loop: internals.ReaderLoop)

    def _linger(self) -> None:
        """After the server's close frame: end our side (FIN after the frame), then read and discard
        what the client still sends until it closes too, within LINGER_S and LINGER_BYTES. Closing
        with its data unread would make the kernel answer with a reset, which can destroy the close
        frame (and its code) before the client reads it."""
        deadline, left = time.monotonic() + LINGER_S, LINGER_BYTES
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while left > 0:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    break
                self.sock.settimeout(wait)
                data = self.sock.recv(65536)
                if not data:
                    break
                left -= len(data)
        except (OSError, ValueError):
            pass

    def _wait_for_room(self) -> bool:
        """Wait until the session takes a message; False (and the connection ends) when it takes
        none for the send timeout."""
        while self.connected and self.unread >= self.max_unread:
            self.room.clear()
            if self.unread < self.max_unread:
                break
            if not self.room.wait(self.send_timeout or None):
                self._end(CloseReason.POLICY_VIOLATION, "not reading")
                return False
        return self.connected

    def _end(self, code: int, reason: str) -> None:
        """Close with ``code`` from the reader (a close frame if it can be written), waking the session."""
        try:
            self.close(code, reason)
        except ConnectionClosed:
            pass
        self.connected = False
        self.event.set()

    def _bound(self, size: int) -> tuple[int, str] | None:
        """(close code, reason) when the message being received, ``size`` bytes so far with its newest
        frame, breaks a bound: too big, too many frames, too slow; else None."""
        if self.max_message_size and size > self.max_message_size:
            return CloseReason.MESSAGE_TOO_BIG, "Message is too big"
        if self.fragments == 0:
            self.message_started = time.monotonic()
        self.fragments += 1
        if self.fragments > MAX_FRAGMENTS:
            return CloseReason.POLICY_VIOLATION, "Message in too many frames"
        if time.monotonic() - self.message_started > MESSAGE_S:
            return CloseReason.POLICY_VIOLATION, "Message took too long"
        return None


class BoundedSock(Sock):
    """flask-sock, serving its routes with BoundedServer (its route wrapper, otherwise unchanged)."""

    def route(self, path: str, bp: Any = None, **kwargs: Any) -> Callable:
        """Register ``f(ws)`` as the WebSocket route ``path`` of the blueprint ``bp``."""
        def decorator(f: Callable) -> Callable:
            @wraps(f)
            def websocket_route(*args: Any, **kwargs: Any) -> Response:
                ws = BoundedServer(request.environ, **current_app.config.get("SOCK_SERVER_OPTIONS", {}))
                try:
                    f(ws, *args, **kwargs)
                except ConnectionClosed:
                    pass
                try:
                    ws.close()
                except Exception:  # already closed, or the peer is gone
                    pass
                # The server closes the socket once this returns: the reader's lingering close first.
                ws.thread.join(LINGER_S + 1)

                class WebSocketResponse(Response):
                    def __call__(self, *args: Any, **kwargs: Any) -> Any:
                        if ws.mode == "gunicorn":
                            raise StopIteration()
                        if ws.mode == "werkzeug":
                            return super().__call__(*args, **kwargs)
                        return []

                return WebSocketResponse()

            kwargs["websocket"] = True
            bp.route(path, **kwargs)(websocket_route)
            return f
        return decorator
