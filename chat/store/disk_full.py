"""A full disk, as the backend reports it, turned into StorageFull for the callers."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..errors import StorageFull

log = logging.getLogger("chat.store")

Method = TypeVar("Method", bound=Callable[..., Any])


def guarded(method: Method) -> Method:
    """The backend's "disk is full" (SQLITE_FULL, PostgreSQL's SQLSTATE 53100) becomes StorageFull;
    the failed statement or transaction changed nothing. ``method``'s object is the Store."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if not self._backend.is_full(exc):
                raise
            log.error("storage is full, a write was refused: %s", exc)
            raise StorageFull() from None
    return cast(Method, wrapper)
