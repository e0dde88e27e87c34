"""SQLite's "database or disk is full", turned into StorageFull for the callers."""
from __future__ import annotations

import functools
import logging
import sqlite3

from ..errors import StorageFull

log = logging.getLogger("chat.store")


def guarded(method):
    """SQLite's "database or disk is full" becomes StorageFull; the failed statement changed nothing."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_FULL:
                raise
            log.error("storage is full, a write was refused: %s", exc)
            raise StorageFull() from None
    return wrapper
