"""Request rate and per-address connection limits (in memory, per worker process)."""
from __future__ import annotations

import time


class RateLimiter:
    """A token bucket per key: ``per_min`` requests a minute, bursts up to the same."""

    def __init__(self, per_min: int):
        self.per_min = per_min
        self.buckets: dict = {}

    def allow(self, key: str) -> bool:
        """Take one token for ``key``; False when its bucket is empty (0 per minute: no limit)."""
        if not self.per_min:
            return True
        now = time.monotonic()
        tokens, last = self.buckets.get(key, (float(self.per_min), now))
        tokens = min(float(self.per_min), tokens + (now - last) * self.per_min / 60.0)
        if tokens < 1:
            self.buckets[key] = (tokens, now)
            return False
        self.buckets[key] = (tokens - 1, now)
        if len(self.buckets) > 10000:  # forget idle clients
            self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < 120}
        return True


class ConnectionCounts:
    """Open WebSocket connections per address, against ``CHAT_MAX_CONNECTIONS_PER_IP``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.by_ip: dict[str, int] = {}

    def full(self, ip: str) -> bool:
        """Whether ``ip`` may open no more connections (0: no limit)."""
        return bool(self.limit) and self.by_ip.get(ip, 0) >= self.limit

    def opened(self, ip: str) -> None:
        self.by_ip[ip] = self.by_ip.get(ip, 0) + 1

    def closed(self, ip: str) -> None:
        left = self.by_ip.get(ip, 1) - 1
        if left > 0:
            self.by_ip[ip] = left
        else:
            self.by_ip.pop(ip, None)
