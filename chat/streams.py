"""The engine interface the web layer sees, and the thread→greenlet bridge under it.

No torch here: engines (local model, remote backend) produce events into a
``Generation`` from real OS threads; the connection's greenlet (or a plain
thread, without gevent) iterates them.
"""
from __future__ import annotations

import collections
import itertools
import sys
import time
from dataclasses import dataclass, field

def gevent_active() -> bool:
    """True when gevent has monkey-patched this process (gunicorn's gevent worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched("threading"))


def _original(module: str, name: str):
    if gevent_active():
        from gevent import monkey
        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


def real_lock():
    """A lock of the OS, usable between real threads even when threading is patched."""
    return _original("_thread", "allocate_lock")()


def start_real_thread(target, *args, name: str = "engine") -> None:
    """Run ``target(*args)`` on a real OS thread, never a greenlet on the event loop."""
    if gevent_active():
        _original("_thread", "start_new_thread")(target, args)
    else:
        import threading
        threading.Thread(target=target, args=args, name=name, daemon=True).start()


def spawn(target, *args) -> None:
    """Run ``target`` concurrently: a greenlet under gevent, else a daemon thread."""
    if gevent_active():
        import gevent
        gevent.spawn(target, *args)
    else:
        import threading
        threading.Thread(target=target, args=args, daemon=True).start()


def real_sleep(seconds: float) -> None:
    """Sleep the calling OS thread (never yields to gevent)."""
    _original("time", "sleep")(seconds)


class Wakeup:
    """A binary semaphore an OS thread waits on; anyone may ``set`` it without blocking."""

    def __init__(self):
        self._lock = real_lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set
            pass

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(True, max(timeout, 0.0))


class Channel:
    """Events from any OS thread to one consumer, which may be a greenlet or a thread.

    Under gevent, a plain ``queue.Queue`` cannot wake a greenlet from another OS
    thread; a hub ``async`` watcher can. The consumer creates the channel, so the
    watcher belongs to the consumer's hub.
    """

    def __init__(self):
        self._items = collections.deque()
        self._closed = False
        if gevent_active():
            import gevent
            from gevent.event import Event
            self._event = Event()
            self._watcher = gevent.get_hub().loop.async_()
            self._watcher.start(self._event.set)
            self._cond = None
        else:
            import threading
            self._watcher = None
            self._cond = threading.Condition()

    def put(self, item) -> None:
        """Thread-safe, never blocks."""
        self._items.append(item)
        if self._watcher is not None:
            self._watcher.send()
        else:
            with self._cond:
                self._cond.notify_all()

    def get(self, timeout: float | None = None):
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

    def close(self) -> None:
        """Release the hub watcher; call from the consumer."""
        if self._watcher is not None and not self._closed:
            self._closed = True
            self._watcher.stop()
            self._watcher.close()


@dataclass
class GenParams:
    """Per-request sampling parameters (already validated)."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple = ()


_ids = itertools.count(1)


@dataclass
class Generation:
    """One answer being made: the engine ``emit``s events, the consumer iterates them.

    Events are dicts: ``{"type": "queued", "position": n}``,
    ``{"type": "start", "prompt_tokens": n}``, ``{"type": "delta", "text": s}``,
    ``{"type": "done", "reason": r, "usage": {...}, "timings": {...}}`` (always last).
    """

    messages: list
    params: GenParams
    key: str | None = None  # conversation key for prefix-cache reuse
    prompt_ids: list | None = None  # set by engines that tokenize at submit time
    serial: int = field(default_factory=lambda: next(_ids))
    cancel_reason: str | None = None
    finished: bool = False
    channel: Channel = field(default_factory=Channel)
    submitted_at: float = field(default_factory=time.monotonic)
    on_cancel: object = None  # engine hook: called (from the canceller) after cancel()

    def emit(self, event: dict) -> None:
        """Called by the engine, from any thread."""
        if event["type"] == "done":
            self.finished = True
        self.channel.put(event)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine to end this generation at its next step with ``done`` ``reason``."""
        if self.cancel_reason is None and not self.finished:
            self.cancel_reason = reason
            if self.on_cancel is not None:
                self.on_cancel(self)

    def next_event(self, timeout: float | None = None):
        """The next event, or None on timeout."""
        return self.channel.get(timeout)

    def __iter__(self):
        """Every event up to and including ``done`` (or an ``error`` before ``start``)."""
        try:
            while True:
                event = self.channel.get()
                yield event
                if event["type"] in ("done", "error"):
                    return
        finally:
            self.close()

    def close(self) -> None:
        self.channel.close()


class Engine:
    """What the web layer needs from an engine (local model or remote backend)."""

    model_name: str = "model"
    ready: bool = False
    error: str | None = None

    def submit(self, messages: list, params: GenParams, key: str | None = None) -> Generation:
        """Queue a generation for ``messages`` (system/user/assistant dicts); never blocks."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Active and queued counts for health and metrics."""
        return {"active": 0, "queued": 0}

    def drain(self) -> None:
        """Stop taking new requests; the ones already taken go on."""

    def shutdown(self, reason: str = "shutdown") -> None:
        """End every generation with ``done`` ``reason`` and stop the engine."""
