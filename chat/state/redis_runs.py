"""Runs seen by every worker: a registry and an event stream per run in Redis.

The worker that runs an answer (its owner) writes each frame to the Redis Stream
``chat:ev:<client>:<rid>`` (capped, expiring after the resume grace) and keeps
``chat:run:<client>:<rid>`` (owner, state) and the conversation's busy flag
leased while it runs. Another worker serves ``resume`` by replaying the stream and
following it live (a ``RemoteRun``; the owner's own sockets keep following it too),
and ``cancel`` by a control message to the owner. When Redis goes away mid-answer
the owner's own sockets keep streaming; only the mirror stops.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import cast

import redis
from redis.client import Pipeline

from ..concurrency import spawn
from ..runs import Run, RunHandle, Subscriber
from .local_runs import LocalRuns
from .redis_conn import LEASE_S, RedisConn, best_effort, required

log = logging.getLogger(__name__)

FOLLOW_TTL_S = 5  # a follower renews its mark faster than this; the owner's grace then waits
BLOCK_MS = 1000
TERMINAL = ("done", "error")
_Entries = list[tuple[str, dict[str, str]]]  # a stream's entries, as read with decode_responses

# Delete the busy flag only if it is still ours (a lapsed lease may have passed it on).
_UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisRuns:
    """``chat.runs.RunRegistry`` for every worker: this worker's runs (a ``LocalRuns``) and, in Redis,
    claims, run records, frame mirrors, cancel and follow (see the module doc)."""

    def __init__(self, conn: RedisConn, resume_grace_s: float, max_frames: int) -> None:
        self.here = LocalRuns()
        self.conn, self.redis = conn, conn.redis
        self.grace = max(1, int(resume_grace_s + 0.999))
        self.max_frames = max_frames
        self.owned: dict[tuple[str, str], Run] = {}  # runs of this worker still answering, for control messages
        self.claims: dict[str, str] = {}  # conversation -> claim value, renewed while held
        self._unclaim = self.redis.register_script(_UNCLAIM)
        conn.renewers.append(self._renew)
        conn.on("cancel", self._on_cancel)

    def _run_key(self, client: str, rid: str) -> str:
        return self.conn.key("run", client, rid)

    def stream_key(self, client: str, rid: str) -> str:
        """The Redis Stream of a run's frames."""
        return self.conn.key("ev", client, rid)

    def _busy_key(self, conversation_id: str) -> str:
        return self.conn.key("busy", conversation_id)

    def _claim_value(self, client: str, rid: str) -> str:
        return f"{client}|{rid}|{self.conn.worker}"

    # ---- the registry (checks for new requests: Redis down raises, and the caller refuses the request)

    def get(self, client: str, rid: str) -> RunHandle | None:
        """A run of this worker, else another worker's (active, or ended within the grace), else None."""
        run = self.here.get(client, rid)
        return run if run is not None else self._remote(client, rid)

    def active(self, client: str, rid: str) -> bool:
        """Whether ``rid`` of ``client`` is still answering, on any worker."""
        run = self.here.get(client, rid)
        if run is not None:
            return not run.finished
        return self._active(client, rid)

    def busy(self, conversation_id: str) -> bool:
        """Whether a request is answering in the conversation, on any worker."""
        return self.here.busy(conversation_id) or self._busy(conversation_id)

    def claim(self, conversation_id: str, client: str, rid: str) -> bool:
        """Mark the conversation busy for this request on every worker; False when another has it."""
        if self.here.busy(conversation_id) or not self._claim(conversation_id, client, rid):
            return False
        return self.here.claim(conversation_id, client, rid)

    def unclaim(self, conversation_id: str, client: str, rid: str) -> None:
        """Free the conversation if this request holds it."""
        self.here.unclaim(conversation_id, client, rid)
        if self.claims.get(conversation_id) == self._claim_value(client, rid):
            self._release_claim(conversation_id)

    def add(self, run: Run) -> None:
        """Register a run this worker just started, and mirror its frames from now on."""
        self.here.add(run)
        self._publish(run)

    def release(self, run: Run) -> None:
        """The run ended: its record and stream stay for the resume grace; the conversation is free."""
        self._finished(run)
        self.unclaim(run.conversation_id, run.client, run.id)

    def forget(self, run: Run) -> None:
        """The resume grace is over: the run is gone here (its keys in Redis lapse by themselves)."""
        self.here.forget(run)

    def followed(self, run: Run) -> bool:
        """Whether a socket on another worker follows ``run`` (so its grace must not cancel it)."""
        try:
            return bool(self.redis.exists(self.conn.key("follow", run.client, run.id)))
        except redis.RedisError:
            return False

    def all_active(self) -> list[Run]:
        """This worker's runs still answering."""
        return self.here.all_active()

    def answering_in(self, client: str | None, conversation_ids: list[str]) -> set[str]:
        """Which of ``client``'s conversations a request of it is answering in now, on any worker
        (one round trip; with Redis away, those of this worker)."""
        found = self.here.answering_in(client, conversation_ids)
        try:
            holders = cast("list[str | None]", self.redis.mget([self._busy_key(c) for c in conversation_ids])
                            if conversation_ids else [])
        except redis.RedisError as exc:
            log.warning("shared state: answering_in failed: %s", exc)
            return found
        return found | {c for c, holder in zip(conversation_ids, holders)
                        if holder and holder.rsplit("|", 2)[0] == client}

    @best_effort
    def answering(self, client: str | None, conversation_id: str) -> dict | None:
        """The run answering in ``client``'s conversation, on any worker, or None."""
        mine = self.here.answering(client, conversation_id)
        if mine is not None:
            return mine
        holder = cast("str | None", self.redis.get(self._busy_key(conversation_id)))
        parts = holder.rsplit("|", 2) if holder else []
        if len(parts) != 3 or parts[0] != client:
            return None
        info = cast("dict[str, str]", self.redis.hgetall(self._run_key(client, parts[1])))
        if info.get("state") != "active":
            return None
        return {"id": parts[1], "message_id": info.get("message_id"),
                "prefix_chars": int(info.get("prefix_chars") or 0)}

    # ---- Redis

    @required
    def _claim(self, conversation_id: str, client: str, rid: str) -> bool:
        value = self._claim_value(client, rid)
        if not self.redis.set(self._busy_key(conversation_id), value, nx=True, ex=LEASE_S):
            return False
        self.claims[conversation_id] = value
        return True

    @best_effort
    def _release_claim(self, conversation_id: str) -> None:
        value = self.claims.pop(conversation_id, None)
        if value is not None:
            self._unclaim(keys=[self._busy_key(conversation_id)], args=[value])

    @required
    def _busy(self, conversation_id: str) -> bool:
        return bool(self.redis.exists(self._busy_key(conversation_id)))

    @required
    def _active(self, client: str, rid: str) -> bool:
        return self.redis.hget(self._run_key(client, rid), "state") == "active"

    @required
    def _remote(self, client: str, rid: str) -> RemoteRun | None:
        """Another worker's run (active, or ended within the grace), or None."""
        info = self.redis.hgetall(self._run_key(client, rid))
        if not info or info.get("worker") == self.conn.worker:
            return None
        return RemoteRun(self, client, rid, info)

    @best_effort
    def _publish(self, run: Run) -> None:
        """Record ``run`` as this worker's and mirror its frames from now on."""
        self.owned[(run.client, run.id)] = run
        key = self._run_key(run.client, run.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"worker": self.conn.worker, "state": "active",
                                "conversation_id": run.conversation_id, "message_id": run.message_id,
                                "prefix_chars": len(run.prefix)})
        pipe.expire(key, LEASE_S)
        pipe.execute()
        run.mirror = Mirror(self, run)

    def _finished(self, run: Run) -> None:
        """Mark the run done; its record and stream stay for the resume grace."""
        self.owned.pop((run.client, run.id), None)
        mirror = run.mirror
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self._run_key(run.client, run.id), "state", "done")
            pipe.expire(self._run_key(run.client, run.id), self.grace)
            pipe.expire(self.stream_key(run.client, run.id), self.grace)
            pipe.execute()
        except redis.RedisError as exc:  # the leases lapse by themselves
            log.warning("shared state: could not close run %s: %s", run.id, exc)
        if isinstance(mirror, Mirror):
            mirror.broken = True

    def _renew(self, pipe: Pipeline, now: float) -> None:
        for conversation_id in list(self.claims):
            pipe.expire(self._busy_key(conversation_id), LEASE_S)
        for client, rid in list(self.owned):
            pipe.expire(self._run_key(client, rid), LEASE_S)
            pipe.expire(self.stream_key(client, rid), LEASE_S)

    def _on_cancel(self, message: dict) -> None:
        run = self.owned.get((message["client"], message["rid"]))
        if run is not None:
            run.cancel("cancelled")



class Mirror:
    """Appends a run's frames to its stream; after a Redis failure it stops (the socket goes on)."""

    def __init__(self, runs: RedisRuns, run: Run) -> None:
        self.redis = runs.redis
        self.key = runs.stream_key(run.client, run.id)
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


class RemoteRun:
    """A run owned by another worker, followed through its stream for one socket here
    (a ``chat.runs.RunHandle``: cancel asks the owner by a control message)."""

    def __init__(self, runs: RedisRuns, client: str, rid: str, info: dict) -> None:
        self.runs, self.redis = runs, runs.redis
        self.client, self.id = client, rid
        self.worker = info["worker"]
        self.conversation_id, self.message_id = info.get("conversation_id"), info.get("message_id")
        self.finished = False
        self.finished_event = threading.Event()
        self.subscriber: Subscriber | None = None
        self.stream = runs.stream_key(client, rid)
        self.follow_key = runs.conn.key("follow", client, rid)

    @required
    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the owner to cancel the answer (its ``done`` comes through the stream)."""
        if not self.finished:
            self.runs.conn.send(self.worker, "cancel", client=self.client, rid=self.id)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this socket stopped following (the run ended, or Redis was lost)."""
        return self.finished_event.wait(timeout)

    @required
    def attach(self, subscriber: Subscriber, start: int) -> None:
        """Replay deltas from ``start`` (and the end, if it came), then follow live."""
        self.redis.set(self.follow_key, self.runs.conn.worker, ex=FOLLOW_TTL_S)
        last = "0-0"
        for entry_id, fields in cast(_Entries, self.redis.xrange(self.stream)):
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
                self.redis.set(self.follow_key, self.runs.conn.worker, ex=FOLLOW_TTL_S)
                reply = cast("list[tuple[str, _Entries]]", self.redis.xread({self.stream: last}, block=BLOCK_MS))
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        last = entry_id
                        frame = json.loads(fields["f"])
                        subscriber = self.subscriber
                        if subscriber is None or not subscriber.send(frame):
                            return
                        if frame["type"] in TERMINAL:
                            return
                if not reply and not self.runs.conn.alive(self.worker):
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

    def detach(self, subscriber: Subscriber) -> None:
        """The socket here went away: stop following; the owner's grace decides the rest."""
        if self.subscriber is subscriber:
            self.subscriber = None
            try:
                self.redis.delete(self.follow_key)
            except redis.RedisError:
                pass
