"""State every worker shares, in Redis (``CHAT_STATE_URL``); without it, each process keeps its own.

Only this package imports ``redis``.
"""
from __future__ import annotations

import logging
import time

from ..concurrency import spawn

log = logging.getLogger(__name__)

RECOVER_EVERY_S = 5.0  # one indexed query for streaming answers


class SharedState:
    """The shared parts of one worker: the connection, the run registry's Redis side, the limits."""

    def __init__(self, settings):
        from .redis_limits import SharedLimits
        from .redis_runs import SharedRuns
        from .redis_conn import Shared
        self.shared = Shared(settings.state_url)
        self.runs = SharedRuns(self.shared, settings.resume_grace_s, settings.max_new_tokens + 16)
        self.limits = SharedLimits(self.shared, settings)

    def alive(self, owner: str | None) -> bool:
        """Whether a streaming answer's writer may be at work: this host's processes are checked
        directly, other hosts' by their heartbeat in Redis."""
        from ..store.liveness import local_alive
        return local_alive(owner, other_hosts=True) and self.shared.alive(owner)

    def start(self, store) -> None:
        """Start the heartbeat and control channel, and sweep answers whose writer died elsewhere."""
        self.shared.start()
        spawn(self._recover, store)

    def _recover(self, store) -> None:
        while not self.shared.closed:
            time.sleep(RECOVER_EVERY_S)
            try:
                if store.recover():
                    log.info("marked answers of dead workers interrupted")
            except Exception:
                log.exception("recover failed")

    def close(self) -> None:
        self.shared.close()
