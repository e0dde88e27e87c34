"""``chat.limits.Limits`` kept in Redis, so every worker and host counts the same requests.

Running answers and open sockets are members of sorted sets scored by a lease
deadline, which the owning worker's heartbeat renews: a worker that dies takes
its counts with it within a lease. Admission is one Lua script, so two workers
cannot both take the last slot. Rate limits are token buckets in hashes.
"""
from __future__ import annotations

import itertools
import time

from redis.client import Pipeline

from ..concurrency import real_lock
from ..config import Settings
from ..engine import Generation
from ..limits import Ticket, follow_generation, rate_key, refusal
from .redis_conn import LEASE_S, RedisConn, best_effort, required

# KEYS: client set, address set, client bucket, address bucket, addresses, waiting
# ARGV: now, ticket, max per client, max per address, client/min, address/min, batch,
#       counts client (0/1), has a client bucket (0/1), address, lease
_ADMIT = """
local now, lease = tonumber(ARGV[1]), tonumber(ARGV[11])
local function level(key, per_min)
  if per_min == 0 then return nil end
  local b = redis.call('HMGET', key, 't', 'ts')
  local tokens, ts = tonumber(b[1]) or per_min, tonumber(b[2]) or now
  return math.min(per_min, tokens + math.max(0, now - ts) * per_min / 60)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local active = redis.call('ZCARD', KEYS[2])
if ARGV[8] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 'client' end
end
local max_address = tonumber(ARGV[4])
if max_address > 0 and active >= max_address then return 'address' end
local client_level = nil
if ARGV[9] == '1' then client_level = level(KEYS[3], tonumber(ARGV[5])) end
local address_level = level(KEYS[4], tonumber(ARGV[6]))
if (client_level and client_level < 1) or (address_level and address_level < 1) then return 'rate' end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
local addresses = redis.call('ZCARD', KEYS[5])
local share = math.max(1, math.ceil(tonumber(ARGV[7]) / math.max(1, addresses)))
if active >= share then
  local mine = ARGV[10] .. '|'
  for _, member in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
    if string.sub(member, 1, #mine) ~= mine then return 'share' end
  end
end
if client_level then
  redis.call('HSET', KEYS[3], 't', client_level - 1, 'ts', now)
  redis.call('EXPIRE', KEYS[3], 120)
end
if address_level then
  redis.call('HSET', KEYS[4], 't', address_level - 1, 'ts', now)
  redis.call('EXPIRE', KEYS[4], 120)
end
local deadline = now + lease
if ARGV[8] == '1' then
  redis.call('ZADD', KEYS[1], deadline, ARGV[2])
  redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
end
redis.call('ZADD', KEYS[2], deadline, ARGV[2])
redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 1)
redis.call('ZADD', KEYS[5], 'GT', deadline, ARGV[10])
redis.call('ZADD', KEYS[6], deadline, ARGV[10] .. '|' .. ARGV[2])
return 'ok'
"""

# KEYS: client set, address set, addresses, waiting; ARGV: ticket, address
_RELEASE = """
if KEYS[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[2] .. '|' .. ARGV[1])
if redis.call('ZCARD', KEYS[2]) == 0 then redis.call('ZREM', KEYS[3], ARGV[2]) end
return 0
"""


# KEYS: the address's socket set; ARGV: now, lease deadline, member, max (0: none), ttl
_CONNECT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local max = tonumber(ARGV[4])
if max > 0 and redis.call('ZCARD', KEYS[1]) >= max then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


# KEYS: client bucket (or ''), address bucket; ARGV: now, client/min, address/min, cost
_SPEND = """
local now, cost = tonumber(ARGV[1]), tonumber(ARGV[4])
local function level(key, per_min)
  if key == '' or per_min == 0 then return nil end
  local b = redis.call('HMGET', key, 't', 'ts')
  local tokens, ts = tonumber(b[1]) or per_min, tonumber(b[2]) or now
  return math.min(per_min, tokens + math.max(0, now - ts) * per_min / 60)
end
local limits = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local levels = {level(KEYS[1], limits[1]), level(KEYS[2], limits[2])}
for i = 1, 2 do
  if levels[i] and levels[i] < math.min(cost, limits[i]) then return 0 end
end
for i = 1, 2 do
  if levels[i] then
    redis.call('HSET', KEYS[i], 't', levels[i] - math.min(cost, limits[i]), 'ts', now)
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
return 1
"""


class RedisTicket:
    """One admitted answer, counted in Redis until released; safe to end from any thread."""

    def __init__(self, limits: "RedisLimits", client: str | None, address: str, id: str) -> None:
        self.limits, self.client, self.address, self.id = limits, client, address, id
        self.waiting = True
        self.released = False
        self.lock = real_lock()  # engine threads end tickets

    def started(self) -> None:
        with self.lock:
            if not self.waiting or self.released:
                return
            self.waiting = False
        self.limits.conn.call_soon(self.limits.started, self)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
        self.limits.conn.call_soon(self.limits.release, self)


class RedisLimits:
    """The same admission rules as ``LocalLimits``, counted across every worker (see the module doc)."""

    def __init__(self, conn: RedisConn, settings: Settings) -> None:
        self.conn, self.redis = conn, conn.redis
        self.max_connections = settings.max_connections_per_ip
        self.max_per_client = settings.max_active_per_connection
        self.max_per_address = settings.max_active_per_ip
        self.batch = settings.max_batch
        self.client_per_min = settings.rate_limit_per_min
        self.address_per_min = settings.rate_limit_per_ip_per_min
        self.lease_s = LEASE_S  # how long a dead worker's counts outlive it
        self.serial = itertools.count(1)
        self.tickets: set = set()  # live tickets of this worker (renewed by the heartbeat)
        self.sockets: dict = {}  # address -> this worker's socket members there
        self._admit = self.redis.register_script(_ADMIT)
        self._release = self.redis.register_script(_RELEASE)
        self._connect = self.redis.register_script(_CONNECT)
        self._spend = self.redis.register_script(_SPEND)
        conn.renewers.append(self._renew)

    def _key(self, *parts: str) -> str:
        return self.conn.key("lim", *parts)

    def _member(self) -> str:
        return f"{self.conn.worker}:{next(self.serial)}"

    # ---- connections

    @required
    def connection_allowed(self, address: str) -> bool:
        if not self.max_connections:
            return True
        key = self._key("conn", address)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", time.time())
        pipe.zcard(key)
        return pipe.execute()[1] < self.max_connections

    @required
    def connect(self, address: str) -> bool:
        """Count one more socket from ``address`` unless it is at the limit: one script, so
        handshakes on every worker at once cannot all take the last place."""
        member = self._member()
        now = time.time()
        if not self._connect(keys=[self._key("conn", address)],
                             args=[now, now + self.lease_s, member, self.max_connections, int(self.lease_s) + 1]):
            return False
        self.sockets.setdefault(address, []).append(member)
        return True

    @best_effort
    def disconnect(self, address: str) -> None:
        members = self.sockets.get(address)
        if not members:
            return
        member = members.pop()
        if not members:
            del self.sockets[address]
        self.redis.zrem(self._key("conn", address), member)

    # ---- answers

    @required
    def admit(self, address: str, client: str | None = None, rid: str | None = None) -> RedisTicket:
        """A ticket for one more answer, or the protocol error that refuses it (as ``LocalLimits.admit``)."""
        ticket = RedisTicket(self, client, address, self._member())
        bucket = rate_key(client, address)
        verdict = self._admit(keys=self._keys(ticket) + [
            self._key("rate", bucket or "-"), self._key("rate", "@" + address), self._key("addresses"),
            self._key("waiting")],
            args=[time.time(), ticket.id, self.max_per_client, self.max_per_address, self.client_per_min,
                  self.address_per_min, self.batch, int(client is not None), int(bucket is not None),
                  address, self.lease_s])
        if verdict != "ok":
            raise refusal(verdict, self, rid)
        self.tickets.add(ticket)
        return ticket

    def track(self, ticket: Ticket, gen: Generation) -> None:
        """Count ``ticket`` until ``gen`` ends."""
        follow_generation(ticket, gen)

    @required
    def spend(self, address: str, client: str | None, cost: int = 1) -> None:
        """Take ``cost`` from the client's and the address's rates (the buckets admit uses), or refuse."""
        bucket = rate_key(client, address)
        if not self._spend(keys=[self._key("rate", bucket) if bucket else "", self._key("rate", "@" + address)],
                           args=[time.time(), self.client_per_min, self.address_per_min, cost]):
            raise refusal("rate", self, None)

    def _client_key(self, client: str | None) -> str:
        return self._key("client", client) if client is not None else ""

    def _keys(self, ticket: RedisTicket) -> list:
        return [self._client_key(ticket.client), self._key("active", ticket.address)]

    def started(self, ticket: RedisTicket) -> None:
        self.redis.zrem(self._key("waiting"), f"{ticket.address}|{ticket.id}")

    def release(self, ticket: RedisTicket) -> None:
        self.tickets.discard(ticket)
        self._release(keys=self._keys(ticket) + [self._key("addresses"), self._key("waiting")],
                      args=[ticket.id, ticket.address])

    def _renew(self, pipe: Pipeline, now: float) -> None:
        deadline, ttl = now + self.lease_s, int(self.lease_s) + 1
        for ticket in list(self.tickets):
            if ticket.client is not None:
                pipe.zadd(self._client_key(ticket.client), {ticket.id: deadline}, xx=True)
                pipe.expire(self._client_key(ticket.client), ttl)
            pipe.zadd(self._key("active", ticket.address), {ticket.id: deadline}, xx=True)
            pipe.expire(self._key("active", ticket.address), ttl)
            pipe.zadd(self._key("addresses"), {ticket.address: deadline}, gt=True)
            if ticket.waiting:
                pipe.zadd(self._key("waiting"), {f"{ticket.address}|{ticket.id}": deadline}, xx=True)
        for address, members in list(self.sockets.items()):
            pipe.zadd(self._key("conn", address), dict.fromkeys(members, deadline))
            pipe.expire(self._key("conn", address), ttl)
