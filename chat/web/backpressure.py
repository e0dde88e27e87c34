"""Bounded sends: a client that stops reading loses its socket, not the server's time."""
from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Any, Iterator

from ..concurrency import gevent_active


class SendTimeout(Exception):
    """A frame could not be written within the send timeout: the peer stopped reading."""


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Raise SendTimeout in the block after ``seconds`` (under gevent; 0 or no gevent: no bound)."""
    if not seconds or not gevent_active():
        yield
        return
    import gevent
    with gevent.Timeout(seconds, SendTimeout):
        yield


class Bound:
    """``within`` for one connection's every send: one timer reused, not one built per frame.

    Frames are small and the send rarely waits, so the timer's start and stop are the whole
    cost; a new ``gevent.Timeout`` (and a context-manager generator) per frame was a measurable
    part of each delta. Not reentrant: the caller serializes its sends.
    """

    def __init__(self, seconds: float) -> None:
        self._timer = None
        if seconds and gevent_active():
            import gevent
            self._timer = gevent.Timeout(seconds, SendTimeout)

    def __enter__(self) -> None:
        if self._timer is not None:
            self._timer.start()  # throws into the greenlet that is sending now

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()


def cut(ws: Any) -> None:
    """Tear the connection down at once: a close frame would wait on the same full buffer.

    The socket's reader then sees the end, and the session ends like any disconnect.
    """
    try:
        ws.sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass
