"""Every private part of simple-websocket, wsproto and gevent the transport leans on, in one place.

The transport bounds what a client can cost by reaching past these libraries' public APIs: it
replaces simple-websocket's reader loop (``ReaderLoop``, whose bounds ``ws_server.BoundedServer``
keeps), writes frames straight to the socket when wsproto negotiated no extension (``text_frame``,
``plain_connection``, used by ``ws.Session``), and writes to gevent's wrapped non-blocking socket
without its per-call waits (``send_now``). No other module of the web layer touches these libraries'
private members (``concurrency._GreenReceiver``, below the web layer, reads gevent's ``_sock``
itself). ``LEANS_ON`` lists everything, and ``problems()`` checks all of it against the installed
versions (``tests/test_internals.py`` fails, naming the library, when a new version moves any of
it). requirements.txt bounds each library to the versions tested.
"""
from __future__ import annotations

import inspect
import re
import selectors
import time
from typing import Any

from simple_websocket import Server
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Ping, Pong, Request, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from . import backpressure

# (library, where, what): a method ``what`` of the class at ``where``, or an attribute ``self.x`` that
# the function at ``where`` assigns.
LEANS_ON: tuple[tuple[str, str, str], ...] = (
    # ReaderLoop replaces the reader loop and keeps the reader's state as it does
    ("simple-websocket", "simple_websocket.ws:Base", "_thread"),
    ("simple-websocket", "simple_websocket.ws:Base", "_handle_events"),
    ("simple-websocket", "simple_websocket.ws:Base", "choose_subprotocol"),
    *(("simple-websocket", "simple_websocket.ws:Base.__init__", f"self.{name}")
      for name in ("sock", "receive_bytes", "ping_interval", "max_message_size", "pong_received",
                   "input_buffer", "incoming_message", "incoming_message_len", "connected", "is_server",
                   "close_reason", "close_message", "selector_class", "event", "ws", "thread")),
    ("simple-websocket", "simple_websocket.ws:Server.__init__", "self.mode"),
    # plain_connection: simple-websocket's wsproto connection, and wsproto's frame protocol in it
    ("wsproto", "wsproto:WSConnection.__init__", "self.connection"),
    ("wsproto", "wsproto.connection:Connection.__init__", "self._proto"),
    ("wsproto", "wsproto.frame_protocol:FrameProtocol.__init__", "self.extensions"),
    # send_now, concurrency._GreenReceiver: gevent's socket wraps a non-blocking one as _sock
    ("gevent", "gevent._socket3:socket.__init__", "self._sock"),
)


def gevent_socket(sock: Any) -> Any:
    """The non-blocking socket gevent's socket wraps (None for any other socket)."""
    return getattr(sock, "_sock", None)


def frame_protocol(conn: Any) -> Any:
    """wsproto's frame protocol inside a connection (its negotiated ``extensions``), or None."""
    return getattr(conn, "_proto", None)


class ReaderLoop(Server):
    """simple-websocket's Server with its reader loop (the private ``_thread`` and ``_handle_events``)
    replaced by one that keeps its state as it does and asks the subclass for every bound: room for
    more input (``_wait_for_room``), a message's size, frames and time (``_bound``), pings (``pings``),
    whole writes (``write``), an end with a close code (``_end``) and a lingering close (``_linger``)."""

    # simple-websocket's own state, which the loop keeps as it does
    connected: bool
    pong_received: bool
    incoming_message: Any
    incoming_message_len: int
    # the bounds' state (ws_server.BoundedServer's)
    unread: int
    max_unread: int
    close_sent: bool
    peer_closed: bool
    fragments: int
    pings: Any

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def _wait_for_room(self) -> bool:
        raise NotImplementedError

    def _end(self, code: int, reason: str) -> None:
        raise NotImplementedError

    def _linger(self) -> None:
        raise NotImplementedError

    def _bound(self, size: int) -> tuple[int, str] | None:
        raise NotImplementedError

    def _thread(self) -> None:
        sel = None
        next_ping = 0.0
        if self.ping_interval:
            next_ping = time.time() + self.ping_interval
            sel = self.selector_class()
            try:
                sel.register(self.sock, selectors.EVENT_READ, True)
            except ValueError:  # pragma: no cover
                self.connected = False
        try:
            while self.connected:
                if self.unread >= self.max_unread and not self._wait_for_room():
                    break
                if sel:
                    now = time.time()
                    if next_ping <= now or not sel.select(next_ping - now):
                        if not self.pong_received:  # the last ping went unanswered: a dead peer
                            self._end(CloseReason.POLICY_VIOLATION, "Ping/Pong timeout")
                            break
                        self.pong_received = False
                        self.write(self.ws.send(Ping()))
                        next_ping = max(now, next_ping) + self.ping_interval
                        continue
                in_data = self.sock.recv(self.receive_bytes)
                if not in_data:
                    raise OSError()
                self.ws.receive_data(in_data)
                self.connected = self._handle_events()
        except (OSError, LocalProtocolError, backpressure.SendTimeout):
            self.connected = False
        finally:
            self.event.set()
            if sel:
                sel.close()
            if self.close_sent and not self.peer_closed:
                self._linger()
            backpressure.cut(self)  # a session still writing to it wakes now
            self.sock.close()

    def _handle_events(self) -> bool:
        out = b""
        for event in self.ws.events():
            try:
                if isinstance(event, Request):
                    self.subprotocol = self.choose_subprotocol(event)
                    out += self.ws.send(AcceptConnection(subprotocol=self.subprotocol,
                                                         extensions=[PerMessageDeflate()]))
                elif isinstance(event, CloseConnection):
                    self.peer_closed = True
                    if self.is_server:
                        out += self.ws.send(event.response())
                    self.close_reason, self.close_message = event.code, event.reason
                    self.write(out)
                    self.connected = False
                    self.event.set()
                    return False
                elif isinstance(event, Ping):
                    if not self.pings.take():
                        self.write(out)
                        self._end(CloseReason.POLICY_VIOLATION, "too many pings")
                        return False
                    out += self.ws.send(event.response())
                elif isinstance(event, Pong):
                    self.pong_received = True
                elif isinstance(event, (TextMessage, BytesMessage)):
                    problem = self._take(event)
                    if problem is not None:
                        self.write(out)
                        self._end(*problem)
                        return False
            except LocalProtocolError:  # pragma: no cover
                self.event.set()
                return False
        self.write(out)
        return True

    def _take(self, event: TextMessage | BytesMessage) -> tuple[int, str] | None:
        """Add a piece of a message; a whole one goes to the session. (close code, reason) when the
        message breaks a bound (``_bound``)."""
        self.incoming_message_len += len(event.data)
        problem = self._bound(self.incoming_message_len)
        if problem is not None:
            return problem
        text = isinstance(event, TextMessage)
        piece: Any = event.data
        if self.incoming_message is None:
            self.incoming_message = piece
        else:
            if not isinstance(self.incoming_message, bytearray):
                first: Any = self.incoming_message
                self.incoming_message = bytearray(first.encode() if isinstance(first, str) else first)
            self.incoming_message += piece.encode() if text else piece
        if not event.message_finished:
            return None
        message: Any = self.incoming_message
        if isinstance(message, bytearray):
            message = message.decode() if text else bytes(message)
        self.incoming_message, self.incoming_message_len, self.fragments = None, 0, 0
        self.input_buffer.append(message)
        self.unread += len(message)
        self.event.set()
        return None


def text_frame(text: str) -> bytes:
    """One final, unmasked text frame (RFC 6455 §5.2): the bytes wsproto writes for a server
    without extensions, built here without its per-message objects."""
    data = text.encode()
    n = len(data)
    if n < 126:
        head = bytes((0x81, n))
    elif n < 65536:
        head = b"\x81\x7e" + n.to_bytes(2, "big")
    else:
        head = b"\x81\x7f" + n.to_bytes(8, "big")
    return head + data


def plain_connection(ws: Any) -> Any:
    """The socket's wsproto connection when frames may be written directly (``text_frame``): a server
    socket with no extension negotiated (permessage-deflate must go through wsproto); else None."""
    conn = getattr(getattr(ws, "ws", None), "connection", None)  # simple-websocket's wsproto connection
    proto = frame_protocol(conn)
    if proto is None or proto.extensions or not getattr(ws, "is_server", False):
        return None
    return conn


def send_all(sock: Any, data: bytes) -> None:
    """``sock.sendall`` without gevent's per-call getsockopt: a frame nearly always goes in one send."""
    sent = sock.send(data)
    while sent < len(data):
        sent += sock.send(data[sent:])


def send_now(sock: Any, data: bytes) -> int:
    """Bytes of ``data`` the kernel takes at once, without waiting (nor a timer): gevent's socket
    wraps a non-blocking one, and a small frame nearly always fits in its buffer."""
    raw = gevent_socket(sock)
    if raw is None or raw.gettimeout() != 0.0:
        return 0
    try:
        return raw.send(data)
    except BlockingIOError:
        return 0


def _find(where: str) -> Any:
    module, _, path = where.partition(":")
    obj: Any = __import__(module, fromlist=["_"])
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """What the installed libraries no longer provide, each naming its library and version."""
    from importlib.metadata import version
    found = []
    for library, where, what in LEANS_ON:
        try:
            obj = _find(where)
            if what.startswith("self."):
                assigned = re.compile(re.escape(what) + r"\s*(?::[^=\n]*)?=(?!=)")
                ok = assigned.search(inspect.getsource(obj)) is not None
            else:
                ok = callable(getattr(obj, what, None))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            ok, what = False, f"{what} ({type(exc).__name__}: {exc})"
        if not ok:
            found.append(f"{library} {version(library)}: {where} no longer has {what!r}")
    return found
