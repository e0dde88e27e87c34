"""A full disk, as the backend reports it, turned into StorageFull for the callers."""
from __future__ import annotations

import functools
import logging

from ..errors import StorageFull

log = logging.getLogger("chat.store")


def guarded(method):
    """The backend's "disk is full" (SQLITE_FULL, PostgreSQL's SQLSTATE 53100) becomes StorageFull;
    the failed statement or transaction changed nothing."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if not self._backend.is_full(exc):
                raise
            log.error("storage is full, a write was refused: %s", exc)
            raise StorageFull() from None
    return wrapper
