"""Finished answers the store refused (a full disk), kept in memory and written when space returns.

An answer streams to its client whatever the disk does; its last write (the whole text and how it
ended) is the one that must not be lost. When that write fails with StorageFull, the answer is kept
here and written again every RETRY_S, before the next turn of any conversation reads a history, and
at shutdown; until then its row says ``streaming``, and the client's ``done`` says it is not stored
yet. What a process still holds when it stops is logged (the row then becomes ``partial`` at the
next start, with the text of its last checkpoint).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .concurrency import spawn
from .errors import StorageFull

log = logging.getLogger(__name__)

RETRY_S = 5.0
NOT_STORED = "storage is full: the answer is kept in memory and saved when space returns"


class Unsaved:
    """Answers' final writes waiting for space: ``keep`` one, ``flush`` them all (any thread)."""

    def __init__(self, write: Callable[..., object]) -> None:
        self.write = write  # the store's finish_assistant
        self.waiting: dict[str, tuple] = {}  # message id -> its finish_assistant arguments, oldest first
        self.lock = threading.Lock()
        self.retrying = False

    def __len__(self) -> int:
        return len(self.waiting)

    def keep(self, message_id: str, *args: object) -> None:
        """Hold ``finish_assistant(message_id, *args)`` until the store takes it; retry in the background."""
        with self.lock:
            self.waiting[message_id] = args
            start, self.retrying = not self.retrying, True
        log.warning("storage is full: answer %s kept in memory (%d waiting) until it can be saved",
                    message_id, len(self.waiting))
        if start:
            spawn(self._retry)

    def flush(self) -> bool:
        """Write what waits, oldest first; whether nothing is left (False: the store is still full)."""
        while self.waiting:
            with self.lock:
                if not self.waiting:
                    break
                message_id, args = next(iter(self.waiting.items()))
            try:
                self.write(message_id, *args)
            except StorageFull:
                return False
            with self.lock:
                if self.waiting.get(message_id) is args:
                    del self.waiting[message_id]
            log.info("answer %s saved now that the store has space", message_id)
        return True

    def _retry(self) -> None:
        while True:
            time.sleep(RETRY_S)
            try:
                done = self.flush()
            except Exception:  # the store closed (shutdown): what is left is logged there
                log.exception("saving kept answers failed")
                done = False
            with self.lock:
                if done and not self.waiting:
                    self.retrying = False
                    return

    def close(self) -> None:
        """A last try; the answers still waiting are logged (their rows hold their last checkpoint)."""
        try:
            self.flush()
        except Exception:
            log.exception("saving kept answers failed")
        if self.waiting:
            log.error("storage still full at shutdown: %d finished answers could not be saved (%s)",
                      len(self.waiting), ", ".join(self.waiting))
