"""Real OS threads under gevent, and the thread→greenlet bridge.

Engines produce events from real OS threads; the connection's greenlet (or a
plain thread, without gevent) consumes them through a ``Channel``.
"""
from __future__ import annotations

import collections
import os
import sys
import time

import socket
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def gevent_active() -> bool:
    """True when gevent has monkey-patched this process (gunicorn's gevent worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched("threading"))


def _original(module: str, name: str):
    if gevent_active():
        from gevent import monkey
        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


def real_lock() -> Any:
    """A lock of the OS, usable between real threads even when threading is patched."""
    return _original("_thread", "allocate_lock")()


def real_spawn(args: list[str]) -> int:
    """Start ``args`` (found on PATH) with no input or output; its pid. Under gevent, neither
    subprocess's nor os's patched functions work from a real OS thread (they need that thread's
    event loop), and the worker's event loop reaps every child as it exits: have the command report
    its own result (see ``real_reap``)."""
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    return _original("os", "posix_spawnp")(args[0], args, dict(os.environ), file_actions=devnull)


def real_reap(pid: int) -> None:
    """Collect an exited child started by ``real_spawn``, unless gevent's event loop already did."""
    try:
        _original("os", "waitpid")(pid, 0)
    except ChildProcessError:
        pass


def start_real_thread(target: Callable[..., object], *args, name: str = "engine") -> None:
    """Run ``target(*args)`` on a real OS thread, never a greenlet on the event loop."""
    if gevent_active():
        _original("_thread", "start_new_thread")(target, args)
    else:
        import threading
        threading.Thread(target=target, args=args, name=name, daemon=True).start()


def spawn(target: Callable[..., object], *args) -> None:
    """Run ``target`` concurrently: a greenlet under gevent, else a daemon thread."""
    if gevent_active():
        import gevent
        gevent.spawn(target, *args)
    else:
        import threading
        threading.Thread(target=target, args=args, daemon=True).start()


def receiver(sock: socket.socket) -> _PlainReceiver | _GreenReceiver:
    """``recv(n)`` for a connected socket with no timeout, at the least cost per call this runtime allows.

    Under gevent, a plain TCP socket is read through the OS socket it wraps, waiting on one
    readiness watcher kept for the connection: gevent's own ``recv`` is a few Python calls per
    read, a caught ``EAGAIN`` and a fresh wait each time. After a read that took less than it
    asked for, the next one waits for readiness first: a stream's reads then never fail with
    ``EAGAIN`` (a system call and an exception per delta). Anything else (TLS, no gevent) is read
    through its own ``recv``. Call ``recv.close()`` when done.
    """
    if gevent_active():
        from gevent.socket import socket as green_socket
        if type(sock) is green_socket and sock.timeout is None:
            return _GreenReceiver(sock)
    return _PlainReceiver(sock)


class _PlainReceiver:
    def __init__(self, sock: socket.socket) -> None:
        self.recv = sock.recv

    def close(self) -> None:
        pass


class _GreenReceiver:
    def __init__(self, sock: Any) -> None:
        import gevent
        # non-blocking: gevent's socket waits for it (a private attribute: gevent is bounded in requirements.txt)
        self._raw = sock._sock
        self._hub = gevent.get_hub()
        self._readable = self._hub.loop.io(self._raw.fileno(), 1)
        self._drained = True  # read once the socket is readable, or right after a full read

    def recv(self, n: int) -> bytes:
        if self._drained:  # the last read took less than it asked for: nothing is left, so wait first
            self._hub.wait(self._readable)
        while True:
            try:
                data = self._raw.recv(n)
            except BlockingIOError:
                self._hub.wait(self._readable)
                continue
            self._drained = len(data) < n
            return data

    def close(self) -> None:
        self._readable.close()


def cooperate() -> None:
    """Let other greenlets run before going on (a no-op without gevent)."""
    if gevent_active():
        import gevent
        gevent.sleep(0)


def real_sleep(seconds: float) -> None:
    """Sleep the calling OS thread (never yields to gevent)."""
    _original("time", "sleep")(seconds)


class Wakeup:
    """A binary semaphore an OS thread waits on; anyone may ``set`` it without blocking."""

    def __init__(self) -> None:
        self._lock = real_lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(True, max(timeout, 0.0))


class Counter:
    """An integer any thread or greenlet may change; readers see a plain int."""

    def __init__(self) -> None:
        self._lock = real_lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class Channel:
    """Events from any OS thread to one consumer, which may be a greenlet or a thread.

    Under gevent, a plain ``queue.Queue`` cannot wake a greenlet from another OS
    thread; a hub ``async`` watcher can. The consumer creates the channel, so the
    watcher belongs to the consumer's hub.
    """

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._closed = False
        if gevent_active():
            import gevent
            from gevent.event import Event
            self._event = Event()
            self._watcher = gevent.get_hub().loop.async_()
            self._watcher.start(self._event.set)
            self._cond: Any = None  # a threading.Condition without gevent
            self._thread_id = _original("_thread", "get_ident")
            self._owner = self._thread_id()
        else:
            import threading
            self._watcher = None
            self._cond = threading.Condition()

    def local(self) -> bool:
        """Whether the caller is a greenlet of the consumer's own thread (never without gevent)."""
        return self._watcher is not None and self._thread_id() == self._owner

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: object) -> None:
        """Thread-safe, never blocks; after ``close`` nobody is woken (the watcher is gone)."""
        self._items.append(item)
        if self._watcher is not None:
            if self._closed:
                return
            if self._thread_id() == self._owner:
                # A greenlet of the consumer's own thread (the remote engine): waking the consumer
                # directly skips the async watcher's extra turn of the event loop on every delta.
                self._event.set()
                return
            try:
                self._watcher.send()
            except Exception:  # closed by the consumer between the check and the send
                pass
        else:
            with self._cond:
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Any:
        """The next item, or None when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            if self._watcher is not None:
                self._event.clear()
                if self._items:
                    continue
                self._event.wait(remaining)
            else:
                with self._cond:
                    if not self._items:
                        self._cond.wait(remaining)

    def peek(self) -> list:
        """The items not yet taken (a snapshot)."""
        return list(self._items)

    def close(self) -> None:
        """Release the hub watcher; call from the consumer."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.close()


class Lane:
    """A few real OS threads for one kind of blocking work, so it never waits behind another kind."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: Any = None

    def run(self, fn: Callable[..., T], *args, timeout: float | None = None) -> T:
        """``fn(*args)`` on one of the lane's threads; under gevent only the calling greenlet waits
        for it, at most ``timeout`` seconds (then LaneTimeout; the thread still finishes ``fn``).
        Without gevent it simply runs here (each request already has a thread of its own)."""
        if not gevent_active():
            return fn(*args)
        if self._pool is None:
            from gevent.threadpool import ThreadPool
            self._pool = ThreadPool(self.threads)
        if timeout is None:
            ok, value = self._pool.apply(_caught, (fn, *args))
        else:
            import gevent
            try:
                ok, value = self._pool.spawn(_caught, fn, *args).get(timeout=max(timeout, 0.0))
            except gevent.Timeout:
                raise LaneTimeout() from None
        if not ok:
            raise value
        return value


def _caught(fn: Callable[..., T], *args) -> tuple[bool, Any]:
    """(True, ``fn(*args)``) or (False, what it raised): an exception that leaves a pool thread is
    printed by gevent's hub as a traceback, even a planned refusal (a bad schema's 400); handed back
    as a value, it is raised in the calling greenlet, where the edge turns it into one response."""
    try:
        return True, fn(*args)
    except Exception as exc:  # raised again by the caller
        return False, exc


class LaneTimeout(Exception):
    """Work on a Lane did not end within the caller's timeout."""


# One dedicated thread: the work is short next to a model step and holds the GIL anyway, and the
# hub's own pool would grow a thread per concurrent caller and keep them.
_tokenizer = Lane(1)


def run_in_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a real OS thread; under gevent only the calling greenlet waits for it.

    For CPU work (tokenizing a long history) that would otherwise hold up every
    connection of the worker; without gevent it simply runs here.
    """
    return _tokenizer.run(fn, *args)
