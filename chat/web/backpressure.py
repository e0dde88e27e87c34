"""Bounded sends: a client that stops reading loses its socket, not the server's time."""
from __future__ import annotations

import socket
from contextlib import contextmanager

from ..concurrency import gevent_active


class SendTimeout(Exception):
    """A frame could not be written within the send timeout: the peer stopped reading."""


@contextmanager
def within(seconds: float):
    """Raise SendTimeout in the block after ``seconds`` (under gevent; 0 or no gevent: no bound)."""
    if not seconds or not gevent_active():
        yield
        return
    import gevent
    with gevent.Timeout(seconds, SendTimeout):
        yield


def cut(ws) -> None:
    """Tear the connection down at once: a close frame would wait on the same full buffer.

    The socket's reader then sees the end, and the session ends like any disconnect.
    """
    try:
        ws.sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass
