"""``chat.limits.Limits`` counted in this process alone: one worker's connections, rates and answers."""
from __future__ import annotations

import math
import time

from ..concurrency import real_lock
from ..config import Settings
from ..engine import Generation
from ..limits import Ticket, follow_generation, rate_key, refusal

IDLE_BUCKETS = 10_000  # past this many buckets, forget the ones idle for a while
IDLE_S = 120.0


class Buckets:
    """Token buckets by key: ``per_min`` a minute, bursts up to the same; 0 means unlimited."""

    def __init__(self, per_min: int) -> None:
        self.per_min = per_min
        self.state: dict = {}

    def _level(self, key: str, now: float) -> float:
        tokens, last = self.state.get(key, (float(self.per_min), now))
        return min(float(self.per_min), tokens + (now - last) * self.per_min / 60.0)

    def has(self, key: str, now: float, cost: int = 1) -> bool:
        """Whether ``cost`` tokens are there (a cost above the bucket's size needs a full bucket)."""
        return not self.per_min or self._level(key, now) >= min(cost, self.per_min)

    def take(self, key: str, now: float, cost: int = 1) -> None:
        if not self.per_min:
            return
        self.state[key] = (self._level(key, now) - min(cost, self.per_min), now)
        if len(self.state) > IDLE_BUCKETS:
            self.state = {k: v for k, v in self.state.items() if now - v[1] < IDLE_S}


def _decrement(counts: dict, key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


class LocalTicket:
    """One admitted answer: counted against its client and address until released."""

    def __init__(self, limits: "LocalLimits", client: str | None, address: str) -> None:
        self.limits, self.client, self.address = limits, client, address
        self.waiting = True  # until the engine starts it
        self.released = False

    def started(self) -> None:
        with self.limits.lock:
            if self.waiting and not self.released:
                self.waiting = False
                _decrement(self.limits.waiting, self.address)

    def release(self) -> None:
        """Stop counting this answer; safe to call twice, from any thread."""
        limits = self.limits
        with limits.lock:
            if self.released:
                return
            self.released = True
            if self.waiting:
                _decrement(limits.waiting, self.address)
            if self.client is not None:
                _decrement(limits.by_client, self.client)
            _decrement(limits.by_address, self.address)


class LocalLimits:
    """Admission for connections and answers, counted in this process (see ``chat.limits``)."""

    def __init__(self, settings: Settings) -> None:
        self.max_connections = settings.max_connections_per_ip
        self.max_per_client = settings.max_active_per_connection
        # An engine-only process hears a few web hosts, which limit their own users: no per-address limits.
        self.per_address = not settings.engine_only
        self.max_per_address = settings.max_active_per_ip if self.per_address else 0
        self.batch = settings.max_batch
        self.client_rate = Buckets(settings.rate_limit_per_min)
        self.address_rate = Buckets(settings.rate_limit_per_ip_per_min if self.per_address else 0)
        self.lock = real_lock()  # tickets are released from engine threads
        self.connections: dict = {}
        self.by_client: dict = {}
        self.by_address: dict = {}
        self.waiting: dict = {}

    # ---- connections

    def connection_allowed(self, address: str) -> bool:
        """Whether ``address`` may open one more socket."""
        with self.lock:
            return not self.max_connections or self.connections.get(address, 0) < self.max_connections

    def connect(self, address: str) -> bool:
        """Count one more open socket from ``address`` unless it is at the limit (then False)."""
        with self.lock:
            count = self.connections.get(address, 0)
            if self.max_connections and count >= self.max_connections:
                return False
            self.connections[address] = count + 1
            return True

    def disconnect(self, address: str) -> None:
        """Count one socket from ``address`` fewer."""
        with self.lock:
            left = self.connections.get(address, 1) - 1
            if left > 0:
                self.connections[address] = left
            else:
                self.connections.pop(address, None)

    # ---- answers

    def admit(self, address: str, client: str | None = None, rid: str | None = None) -> LocalTicket:
        """A ticket for one more answer, or the protocol error that refuses it (in protocol order).

        ``client`` None (``/v1``) counts only against the address.
        """
        now = time.monotonic()
        key = rate_key(client, address)
        with self.lock:
            active = self.by_address.get(address, 0)
            if client is not None and self.by_client.get(client, 0) >= self.max_per_client:
                raise refusal("client", self, rid)
            if self.max_per_address and active >= self.max_per_address:
                raise refusal("address", self, rid)
            if not ((key is None or self.client_rate.has(key, now)) and self.address_rate.has(address, now)):
                raise refusal("rate", self, rid)
            if self.per_address and active >= self.fair_share() and self._others_waiting(address):
                raise refusal("share", self, rid)
            if key is not None:
                self.client_rate.take(key, now)
            self.address_rate.take(address, now)
            if client is not None:
                self.by_client[client] = self.by_client.get(client, 0) + 1
            self.by_address[address] = active + 1
            self.waiting[address] = self.waiting.get(address, 0) + 1
            return LocalTicket(self, client, address)

    def spend(self, address: str, client: str | None, cost: int = 1) -> None:
        """Take ``cost`` from the client's and the address's rates, or refuse (``rate_limited``)."""
        now = time.monotonic()
        key = rate_key(client, address)
        with self.lock:
            if not ((key is None or self.client_rate.has(key, now, cost))
                    and self.address_rate.has(address, now, cost)):
                raise refusal("rate", self, None)
            if key is not None:
                self.client_rate.take(key, now, cost)
            self.address_rate.take(address, now, cost)

    def fair_share(self) -> int:
        """Batch slots for each address that has answers running or waiting."""
        return max(1, math.ceil(self.batch / max(1, len(self.by_address))))

    def _others_waiting(self, address: str) -> bool:
        return any(count for addr, count in self.waiting.items() if addr != address)

    def track(self, ticket: Ticket, gen: Generation) -> None:
        """Count ``ticket`` until ``gen`` ends."""
        follow_generation(ticket, gen)
