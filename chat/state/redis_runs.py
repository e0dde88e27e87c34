"""Runs seen by every worker: a registry and an event stream per run in Redis.

The worker that runs an answer (its owner) writes each frame to the Redis Stream
``chat:ev:<client>:<rid>`` (capped, expiring after the resume grace) and keeps
``chat:run:<client>:<rid>`` (owner, state) and the conversation's busy flag
leased while it runs. Another worker serves ``resume`` by replaying the stream and
following it live (a ``RemoteRun``), and ``cancel`` by a control message to the
owner. When Redis goes away mid-answer the owner's own socket keeps streaming;
only the mirror stops.
"""
from __future__ import annotations

import json
import logging
import threading

import redis

from ..concurrency import spawn
from .redis_conn import LEASE_S, Shared, best_effort, required

log = logging.getLogger(__name__)

FOLLOW_TTL_S = 5  # a follower renews its mark faster than this; the owner's grace then waits
BLOCK_MS = 1000
TERMINAL = ("done", "error")

# Delete the busy flag only if it is still ours (a lapsed lease may have passed it on).
_UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SharedRuns:
    """The Redis side of ``runs.Runs``: claims, run records, frame mirrors, cancel and follow."""

    def __init__(self, shared: Shared, resume_grace_s: float, max_frames: int):
        self.shared, self.redis = shared, shared.redis
        self.grace = max(1, int(resume_grace_s + 0.999))
        self.max_frames = max_frames
        self.local: dict = {}  # (client, rid) -> Run this worker owns, for control messages
        self.claims: dict = {}  # conversation -> claim value, renewed while held
        self._unclaim = self.redis.register_script(_UNCLAIM)
        shared.renewers.append(self._renew)
        shared.on("cancel", self._on_cancel)
        shared.on("moved", self._on_moved)

    def _run_key(self, client: str, rid: str) -> str:
        return self.shared.key("run", client, rid)

    def _stream_key(self, client: str, rid: str) -> str:
        return self.shared.key("ev", client, rid)

    def _busy_key(self, conversation_id: str) -> str:
        return self.shared.key("busy", conversation_id)

    # ---- checks (new requests: Redis down raises, and the caller refuses the request)

    @required
    def claim(self, conversation_id: str, client: str, rid: str) -> bool:
        value = f"{client}|{rid}|{self.shared.worker}"
        if not self.redis.set(self._busy_key(conversation_id), value, nx=True, ex=LEASE_S):
            return False
        self.claims[conversation_id] = value
        return True

    @best_effort
    def unclaim(self, conversation_id: str) -> None:
        value = self.claims.pop(conversation_id, None)
        if value is not None:
            self._unclaim(keys=[self._busy_key(conversation_id)], args=[value])

    @required
    def busy(self, conversation_id: str) -> bool:
        return bool(self.redis.exists(self._busy_key(conversation_id)))

    @required
    def active(self, client: str, rid: str) -> bool:
        return self.redis.hget(self._run_key(client, rid), "state") == "active"

    @required
    def remote(self, client: str, rid: str) -> "RemoteRun | None":
        """Another worker's run (active, or ended within the grace), or None."""
        info = self.redis.hgetall(self._run_key(client, rid))
        if not info or info.get("worker") == self.shared.worker:
            return None
        return RemoteRun(self, client, rid, info)

    # ---- the owner's side

    @best_effort
    def publish(self, run) -> None:
        """Record ``run`` as this worker's and mirror its frames from now on."""
        self.local[(run.client, run.id)] = run
        key = self._run_key(run.client, run.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"worker": self.shared.worker, "state": "active",
                                "conversation_id": run.conversation_id, "message_id": run.message_id})
        pipe.expire(key, LEASE_S)
        pipe.execute()
        run.mirror = Mirror(self, run)

    def finished(self, run) -> None:
        """The run ended: its record and stream stay for the resume grace (``Runs.release`` then
        frees the conversation)."""
        self.local.pop((run.client, run.id), None)
        mirror = run.mirror
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self._run_key(run.client, run.id), "state", "done")
            pipe.expire(self._run_key(run.client, run.id), self.grace)
            pipe.expire(self._stream_key(run.client, run.id), self.grace)
            pipe.execute()
        except redis.RedisError as exc:  # the leases lapse by themselves
            log.warning("shared state: could not close run %s: %s", run.id, exc)
        if mirror is not None:
            mirror.broken = True

    def followed(self, run) -> bool:
        """Whether a socket on another worker follows ``run`` (so its grace must not cancel it)."""
        try:
            return bool(self.redis.exists(self.shared.key("follow", run.client, run.id)))
        except redis.RedisError:
            return False

    def _renew(self, pipe, now: float) -> None:
        for conversation_id in list(self.claims):
            pipe.expire(self._busy_key(conversation_id), LEASE_S)
        for client, rid in list(self.local):
            pipe.expire(self._run_key(client, rid), LEASE_S)
            pipe.expire(self._stream_key(client, rid), LEASE_S)

    def _on_cancel(self, message: dict) -> None:
        run = self.local.get((message["client"], message["rid"]))
        if run is not None:
            run.gen.cancel("cancelled")

    def _on_moved(self, message: dict) -> None:
        run = self.local.get((message["client"], message["rid"]))
        if run is not None:
            run.hand_over()


class Mirror:
    """Appends a run's frames to its stream; after a Redis failure it stops (the socket goes on)."""

    def __init__(self, runs: SharedRuns, run):
        self.redis = runs.redis
        self.key = runs._stream_key(run.client, run.id)
        self.maxlen = runs.max_frames
        self.broken = False
        self.fresh = True
        self.run_id = run.id

    def __call__(self, frame: dict) -> None:
        if self.broken:
            return
        try:
            if self.fresh:  # the stream is born here: give it its lease at once, not at the next beat
                self.fresh = False
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(self.key, {"f": json.dumps(frame, ensure_ascii=False)})
                pipe.expire(self.key, LEASE_S)
                pipe.execute()
                return
            self.redis.xadd(self.key, {"f": json.dumps(frame, ensure_ascii=False)}, maxlen=self.maxlen,
                            approximate=True)
        except redis.RedisError as exc:
            self.broken = True
            log.warning("shared state: run %s no longer mirrored (%s); its socket keeps streaming",
                        self.run_id, exc)


class _Cancel:
    """``run.gen`` of a RemoteRun: cancel asks the owner."""

    def __init__(self, run: "RemoteRun"):
        self.run = run

    @required
    def cancel(self, reason: str = "cancelled") -> None:
        run = self.run
        if not run.finished:
            run.runs.shared.send(run.worker, "cancel", client=run.client, rid=run.id)


class RemoteRun:
    """A run owned by another worker, followed through its stream for one socket here."""

    def __init__(self, runs: SharedRuns, client: str, rid: str, info: dict):
        self.runs, self.redis = runs, runs.redis
        self.client, self.id = client, rid
        self.worker = info["worker"]
        self.conversation_id, self.message_id = info.get("conversation_id"), info.get("message_id")
        self.finished = False
        self.finished_event = threading.Event()
        self.gen = _Cancel(self)
        self.subscriber = None
        self.stream = runs._stream_key(client, rid)
        self.follow_key = runs.shared.key("follow", client, rid)

    @required
    def attach(self, subscriber, start: int) -> None:
        """Replay deltas from ``start`` (and the end, if it came), then follow live."""
        self.redis.set(self.follow_key, self.runs.shared.worker, ex=FOLLOW_TTL_S)
        self.runs.shared.send(self.worker, "moved", client=self.client, rid=self.id)
        last = "0-0"
        for entry_id, fields in self.redis.xrange(self.stream):
            last = entry_id
            frame = json.loads(fields["f"])
            if frame["type"] == "delta" and frame["index"] < start:
                continue
            if frame["type"] in ("delta", *TERMINAL) and not subscriber.send(frame):
                return self._end()
            if frame["type"] in TERMINAL:
                return self._end()
        self.subscriber = subscriber
        spawn(self._follow, last)

    def _follow(self, last: str) -> None:
        try:
            while self.subscriber is not None:
                self.redis.set(self.follow_key, self.runs.shared.worker, ex=FOLLOW_TTL_S)
                reply = self.redis.xread({self.stream: last}, block=BLOCK_MS)
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        last = entry_id
                        frame = json.loads(fields["f"])
                        subscriber = self.subscriber
                        if subscriber is None or not subscriber.send(frame):
                            return
                        if frame["type"] in TERMINAL:
                            return
                if not reply and not self.runs.shared.alive(self.worker):
                    self._owner_died()
                    return
        except redis.RedisError as exc:
            log.warning("shared state: lost run %s while following it: %s", self.id, exc)
        finally:
            self._end()

    def _owner_died(self) -> None:
        """The worker running the answer is gone with no end written: end it here as an error
        (the store marks its partial text interrupted)."""
        log.warning("run %s: its worker %s died; ended as an error", self.id, self.worker)
        subscriber = self.subscriber
        if subscriber is not None:
            subscriber.send({"type": "done", "id": self.id, "reason": "error", "usage": {}, "timings": {}})

    def _end(self) -> None:
        self.finished = True
        subscriber, self.subscriber = self.subscriber, None
        try:
            self.redis.delete(self.follow_key)
        except redis.RedisError:
            pass
        self.finished_event.set()
        if subscriber is not None:
            subscriber.forget(self)

    def detach(self, subscriber) -> None:
        """The socket here went away: stop following; the owner's grace decides the rest."""
        if self.subscriber is subscriber:
            self.subscriber = None
            try:
                self.redis.delete(self.follow_key)
            except redis.RedisError:
                pass
