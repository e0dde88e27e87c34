"""gunicorn's gevent worker with two bounds on connections, for a server that faces clients itself.

gunicorn waits for a new connection's request line as long as its keep-alive (75 s here), and holds
up to ``worker_connections`` sockets from anyone: about a thousand idle sockets from one address took
a worker offline. Here a connection must send its request line and headers within
CHAT_HEADER_TIMEOUT_S, and, without a proxy in front (CHAT_TRUSTED_PROXIES=0, so the peer is the
client), one address holds at most CHAT_MAX_CONNECTIONS_PER_IP connections of a worker, plain HTTP
and WebSocket together; one more is answered 429 and closed before anything of it is read. Behind
a proxy the peer is the proxy: the app counts WebSockets by the forwarded address, and the proxy
bounds the rest (docs/deployment.md).
"""
from __future__ import annotations

import json
import time
from typing import Any

import gevent
from gunicorn.workers.ggevent import GeventWorker  # type: ignore[import-untyped]

from ..config import Settings
from ..limits import address_of

LOG_EVERY_S = 60.0  # one refusal line per address a minute, not one per socket
_REFUSAL = json.dumps({"error": {"code": "rate_limited",
                                 "message": "too many open connections from your address"}}).encode()
REFUSED = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Retry-After: 5\r\nContent-Length: " + str(len(_REFUSAL)).encode() + b"\r\n\r\n" + _REFUSAL)


class Worker(GeventWorker):
    """See the module doc. ``open`` counts each address's connections (one event loop: no lock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = Settings.from_env()
        self.header_timeout = settings.header_timeout_s
        self.cap = settings.max_connections_per_ip if not settings.trusted_proxies else 0
        self.open: dict[str, int] = {}
        self.logged: dict[str, float] = {}

    def timeout_ctx(self) -> gevent.Timeout:
        """The wait for a request's line and headers: CHAT_HEADER_TIMEOUT_S for a connection's first
        request, the keep-alive between later ones (gunicorn calls this before each request)."""
        current: Any = gevent.getcurrent()
        first = not getattr(current, "chat_served", False)
        current.chat_served = True
        return gevent.Timeout(self.header_timeout if first else self.cfg.keepalive, False)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        """Serve the connection unless its address already holds its share of this worker."""
        key = address_of(str(addr[0])) if self.cap and isinstance(addr, tuple) and addr else None
        if key is not None:
            if self.open.get(key, 0) >= self.cap:
                self._refuse(client, key)
                return
            self.open[key] = self.open.get(key, 0) + 1
        try:
            gevent.getcurrent().chat_served = False
            super().handle(listener, client, addr)
        finally:
            if key is not None:
                left = self.open.get(key, 1) - 1
                if left > 0:
                    self.open[key] = left
                else:
                    self.open.pop(key, None)

    def _refuse(self, client: Any, key: str) -> None:
        """429 and close, reading nothing; one log line per address a minute."""
        now = time.monotonic()
        if now - self.logged.get(key, 0.0) >= LOG_EVERY_S:
            self.logged = {k: t for k, t in self.logged.items() if now - t < LOG_EVERY_S}
            self.logged[key] = now
            self.log.warning("refused connections from %s: it holds %d, the most one address may "
                             "(CHAT_MAX_CONNECTIONS_PER_IP)", key, self.cap)
        try:
            client.settimeout(1.0)
            client.sendall(REFUSED)
        except OSError:
            pass
        finally:
            client.close()
