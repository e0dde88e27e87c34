"""The connection to Redis every worker shares: who is alive, and a control channel per worker.

Each app (one per gunicorn worker) gets a worker id. A heartbeat greenlet keeps
``chat:alive:<host>:<pid>`` set while the process lives (the store asks it whether a
streaming answer's writer still runs) and renews the leases its parts hold (runs,
busy flags, limit tickets). Other workers reach this one by publishing on
``chat:ctl:<worker>``: a cancel for a run it owns.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable, TypeVar, cast

import redis

from ..concurrency import Channel, spawn
from ..errors import ProtocolError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512  # Redis connections of one worker at once (each greenlet or thread holds one per call)
F = TypeVar("F", bound=Callable[..., Any])

HEARTBEAT_S = 2.0
ALIVE_TTL_S = 10  # a process silent this long is taken for dead
LEASE_S = 30  # what a heartbeat renews: a dead worker's leases lapse within this
CONFIRM_DEAD_S = 10  # a process silent this long (after its beat's ALIVE_TTL_S lapsed) is dead


class StateUnavailable(ProtocolError):
    """Redis cannot be reached: new requests are refused until it is back; running ones go on."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__("overloaded", "the server's shared state is unreachable: try again shortly", id)


def required(method: F) -> F:
    """For what a new request needs from Redis: a Redis failure refuses it with StateUnavailable."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except redis.RedisError as exc:
            log.warning("shared state unreachable: %s", exc)
            raise StateUnavailable() from None
    return cast(F, wrapper)


def best_effort(method: F) -> F:
    """For what a running answer does in Redis: a failure is logged and the answer goes on."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except redis.RedisError as exc:
            log.warning("shared state: %s failed: %s", method.__name__, exc)
    return cast(F, wrapper)


def process_key() -> str:
    """This process, as the store's answer owners name it (``host:pid``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class RedisConn:
    """One Redis client, this worker's identity, its heartbeat and its control channel."""

    def __init__(self, url: str, prefix: str = "chat:") -> None:
        self.url, self.prefix = url, prefix
        # redis-py 8 caps a pool at 100 connections and then raises "Too many connections"; a worker's
        # greenlets and threads can hold more at once: a larger pool that waits for a free connection.
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS, timeout=5,
                                                     socket_timeout=5, socket_connect_timeout=2,
                                                     health_check_interval=30, decode_responses=True)
        self.redis = redis.Redis(connection_pool=pool)
        self.worker = f"{process_key()}:{uuid.uuid4().hex[:8]}"
        self.handlers: dict = {}  # control op -> fn(message)
        self.renewers: list = []  # fn(pipeline, now), called on every heartbeat
        self.silent_since: dict = {}  # host:pid -> when its heartbeat was first found missing
        self.closed = False
        self.calls = Channel()  # work from engine threads, done on this hub (see call_soon)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def start(self) -> None:
        """Start the heartbeat, the control listener and the hub-side call loop."""
        spawn(self._heartbeat)
        spawn(self._listen)
        spawn(self._run_calls)

    def close(self) -> None:
        self.closed = True
        self.calls.put(None)

    # ---- liveness

    def alive(self, owner: str | None) -> bool:
        """Whether the process that wrote ``owner`` (``host:pid:...``) may still be running.

        False only once it has missed its heartbeat for CONFIRM_DEAD_S: a Redis restart wipes
        every beat for a moment, and a live writer's answer must never be marked interrupted.
        """
        host, _, rest = (owner or "").partition(":")
        pid = rest.split(":", 1)[0]
        if not host or not pid.isdigit():
            return False
        process = f"{host}:{pid}"
        try:
            beating = bool(self.redis.exists(self.key("alive", process)))
        except redis.RedisError:
            return True  # never mark another's answer interrupted on a guess
        now = time.monotonic()
        if beating:
            self.silent_since.pop(process, None)
            return True
        return now - self.silent_since.setdefault(process, now) < CONFIRM_DEAD_S

    def _heartbeat(self) -> None:
        while not self.closed:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(self.key("alive", process_key()), self.worker, ex=ALIVE_TTL_S)
                now = time.time()
                for renew in list(self.renewers):
                    renew(pipe, now)
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("shared state: heartbeat failed: %s", exc)
            time.sleep(HEARTBEAT_S)

    # ---- control messages between workers

    def on(self, op: str, handler: Callable[[dict], None]) -> None:
        self.handlers[op] = handler

    def send(self, worker: str, op: str, **fields) -> None:
        """Publish one control message to ``worker``."""
        self.redis.publish(self.key("ctl", worker), json.dumps({"op": op, **fields}))

    def _listen(self) -> None:
        channel = self.key("ctl", self.worker)
        while not self.closed:
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                for message in pubsub.listen():
                    if self.closed:
                        return
                    self._dispatch(message.get("data"))
            except redis.RedisError as exc:
                if self.closed:
                    return
                log.warning("shared state: control channel lost (%s); resubscribing", exc)
                time.sleep(1)

    def _dispatch(self, data: Any) -> None:
        try:
            message = json.loads(data)
            handler = self.handlers[message["op"]]
        except (TypeError, ValueError, KeyError):
            log.warning("shared state: ignored control message %r", data)
            return
        try:
            handler(message)
        except Exception:
            log.exception("shared state: control message %r failed", data)

    # ---- calls from other threads

    def call_soon(self, fn: Callable[..., object], *args) -> None:
        """Run ``fn(*args)`` on this worker's hub: Redis's sockets belong to it, not to engine threads."""
        self.calls.put((fn, args))

    def _run_calls(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except redis.RedisError as exc:
                log.warning("shared state: %s failed: %s", getattr(fn, "__name__", fn), exc)
            except Exception:
                log.exception("shared state: %s failed", getattr(fn, "__name__", fn))
