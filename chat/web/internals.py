"""Every private part of simple-websocket, wsproto and gevent the transport leans on, in one place.

The transport bounds what a client can cost by reaching past these libraries' public APIs: it
replaces simple-websocket's reader loop (``ws_server.BoundedServer``), writes frames straight to
the socket when wsproto negotiated no extension (``ws.Session``), and reads and writes gevent's
wrapped non-blocking socket without its per-call waits (``ws._send_now``, ``concurrency``). ws.py
reads private attributes through the accessors below (``concurrency._GreenReceiver``, below the web
layer, reads gevent's ``_sock`` itself); ``LEANS_ON`` lists everything, and
``problems()`` checks all of it against the installed versions (``tests/test_internals.py``
fails, naming the library, when a new version moves any of it). requirements.txt bounds each
library to the versions tested.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

# (library, where, what): a method ``what`` of the class at ``where``, or an attribute ``self.x`` that
# the function at ``where`` assigns.
LEANS_ON: tuple[tuple[str, str, str], ...] = (
    # ws_server.BoundedServer replaces the reader loop and keeps the reader's state as it does
    ("simple-websocket", "simple_websocket.ws:Base", "_thread"),
    ("simple-websocket", "simple_websocket.ws:Base", "_handle_events"),
    ("simple-websocket", "simple_websocket.ws:Base", "choose_subprotocol"),
    *(("simple-websocket", "simple_websocket.ws:Base.__init__", f"self.{name}")
      for name in ("sock", "receive_bytes", "ping_interval", "max_message_size", "pong_received",
                   "input_buffer", "incoming_message", "incoming_message_len", "connected", "is_server",
                   "close_reason", "close_message", "selector_class", "event", "ws", "thread")),
    ("simple-websocket", "simple_websocket.ws:Server.__init__", "self.mode"),
    # ws.plain_connection: simple-websocket's wsproto connection, and wsproto's frame protocol in it
    ("wsproto", "wsproto:WSConnection.__init__", "self.connection"),
    ("wsproto", "wsproto.connection:Connection.__init__", "self._proto"),
    ("wsproto", "wsproto.frame_protocol:FrameProtocol.__init__", "self.extensions"),
    # ws._send_now, concurrency._GreenReceiver: gevent's socket wraps a non-blocking one as _sock
    ("gevent", "gevent._socket3:socket.__init__", "self._sock"),
)


def gevent_socket(sock: Any) -> Any:
    """The non-blocking socket gevent's socket wraps (None for any other socket)."""
    return getattr(sock, "_sock", None)


def frame_protocol(conn: Any) -> Any:
    """wsproto's frame protocol inside a connection (its negotiated ``extensions``), or None."""
    return getattr(conn, "_proto", None)


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
