"""Search, off the event loop: its own threads, a time budget, and only a few at once.

A search is the one read whose cost a client can grow at will (import long texts, then search a
prefix that matches all of them); run on the event loop it would hold up every other connection of
the worker. It runs on threads of its own instead, under CHAT_SEARCH_TIMEOUT_S counted from its
arrival (time spent waiting for a thread included), and a worker takes at most MAX_SEARCHES at once,
MAX_PER_ADDRESS of them from one address; more are refused with ``overloaded`` at once.
"""
from __future__ import annotations

import time
from typing import Any

from .concurrency import Lane, LaneTimeout, real_lock
from .errors import ProtocolError, SearchTimeout

THREADS = 2
MAX_SEARCHES = 8
MAX_PER_ADDRESS = 2
GRACE_S = 0.25  # past the budget, for the backend to report its own timeout


class Searches:
    """Runs the searches of one worker (see the module doc)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.lane = Lane(THREADS)
        self.lock = real_lock()  # search threads release their count
        self.running: dict[str, int] = {}  # address -> searches admitted and not yet ended

    def run(self, store: Any, client: str | None, address: str, text: str) -> list[dict]:
        """``store.search`` for ``client`` on a search thread, within the budget; ``overloaded``
        when too many searches are under way, SearchTimeout past the budget."""
        deadline = time.monotonic() + self.budget_s
        with self.lock:
            if sum(self.running.values()) >= MAX_SEARCHES or self.running.get(address, 0) >= MAX_PER_ADDRESS:
                raise ProtocolError("overloaded", "too many searches at once; try again in a moment")
            self.running[address] = self.running.get(address, 0) + 1

        def search() -> list[dict]:
            try:
                return store.search(client, text, deadline)
            finally:  # counted until the thread is free again, even when nobody waits for it
                with self.lock:
                    self.running[address] -= 1
                    if not self.running[address]:
                        del self.running[address]

        try:
            # The backends stop their query at the deadline; a step they cannot interrupt (a huge
            # prefix expanded inside FTS5) ends on its thread while the client has its answer.
            return self.lane.run(search, timeout=deadline - time.monotonic() + GRACE_S)
        except LaneTimeout:
            raise SearchTimeout() from None
