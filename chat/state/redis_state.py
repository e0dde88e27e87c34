"""Runs and limits shared by every worker in Redis (``CHAT_STATE_URL``), and liveness through it."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..concurrency import spawn
from .redis_conn import RedisConn
from .redis_limits import RedisLimits
from .redis_runs import RedisRuns

if TYPE_CHECKING:
    from ..config import Settings
    from ..store import Store

log = logging.getLogger(__name__)

RECOVER_EVERY_S = 5.0  # one indexed query for streaming answers


class RedisState:
    """A ``chat.state.StateBackend`` in Redis: the connection, the run registry, the limits."""

    def __init__(self, settings: Settings) -> None:
        self.conn = RedisConn(settings.state_url)
        self.runs = RedisRuns(self.conn, settings.resume_grace_s, settings.max_new_tokens + 16)
        self.limits = RedisLimits(self.conn, settings)

    def alive(self, owner: str | None) -> bool:
        """Whether a streaming answer's writer may be at work: this host's processes are checked
        directly, other hosts' by their heartbeat in Redis."""
        from ..store.liveness import local_alive
        return local_alive(owner, other_hosts=True) and self.conn.alive(owner)

    def start(self, store: Store | None) -> None:
        """Start the heartbeat and control channel, and sweep answers whose writer died elsewhere."""
        self.conn.start()
        if store is not None:
            spawn(self._recover, store)

    def _recover(self, store: Store) -> None:
        while not self.conn.closed:
            time.sleep(RECOVER_EVERY_S)
            try:
                if store.recover():
                    log.info("marked answers of dead workers interrupted")
            except Exception:
                log.exception("recover failed")

    def close(self) -> None:
        """Stop the heartbeat and the control channel (the leases this worker held then lapse)."""
        self.conn.close()
