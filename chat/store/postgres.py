"""The PostgreSQL backend (psycopg 3): a small pool of autocommit connections; the store's SQL
with psycopg's ``%s`` parameter marks.

Under gevent, psycopg waits on its socket with the patched ``select`` when it is imported after
monkey-patching (gunicorn's gevent worker imports the app after patching): a query suspends
only its greenlet. Imported before, it keeps its C wait, which blocks the whole hub for the
query; ``_green`` switches it to the patched one. Real OS threads (engine threads, gevent's
thread pool) wait on their own.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..concurrency import gevent_active, real_lock
from ..errors import SearchTimeout
from . import pg_schema, search as fts

POOL_SIZE = 8  # connections one Store opens at most; more callers wait their turn
WAIT_S = 0.005
DISK_FULL = "53100"
QUERY_CANCELED = "57014"  # statement_timeout


def _green(psycopg: Any) -> None:
    """Make psycopg wait through the patched ``select.poll`` when it chose its C wait before
    gevent patched the process (psycopg looks up ``waiting.wait`` on each query)."""
    waiting = psycopg.waiting
    if gevent_active() and waiting.wait is waiting.wait_c:
        waiting.wait = waiting.wait_poll


def is_url(target: str) -> bool:
    """Whether CHAT_DB names a PostgreSQL database rather than an SQLite file."""
    return target.startswith(("postgresql://", "postgres://"))


class Row(dict):
    """A row by column name, by position, and as a dict, like sqlite3.Row."""

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


def _rows(cursor: Any) -> Callable[[Sequence[Any]], Row]:
    """psycopg's row factory for Row."""
    names = [c.name for c in cursor.description or ()]
    return lambda values: Row(zip(names, values))


def _args(args: Sequence[Any]) -> tuple:
    """PostgreSQL text cannot hold NUL: stored as U+FFFD (SQLite would keep it)."""
    return tuple(a.replace("\x00", "\ufffd") if isinstance(a, str) and "\x00" in a else a for a in args)


class Connection:
    """One pooled connection as a ``backend.Connection``."""

    mark = "%s"
    # Read-then-write in a transaction (the active leaf a new message hangs under) locks the
    # row it read: READ COMMITTED would let two processes append under the same leaf.
    lock_rows = " FOR UPDATE"

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, statement: str, args: Sequence[Any] = (), /) -> Any:
        """Run one statement; without arguments psycopg reads no marks in it (a ``%`` stays itself)."""
        return self.raw.execute(statement, _args(args) if args else None)

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]], /) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(statement, [_args(r) for r in rows])

    def transaction(self) -> AbstractContextManager[object]:
        return self.raw.transaction()

    def reindex(self, message_id: str) -> None:
        """Nothing: the search indexes are expression indexes, kept by PostgreSQL itself."""

    def lock(self, key: str) -> None:
        """Hold a lock named ``key`` until the transaction ends: a check-then-insert (a quota)
        stays true for one writer at a time, across processes and hosts."""
        self.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))


class PostgreSQL:
    """Connections to one database, lent to one caller at a time and kept for the next."""

    kind = "postgresql"
    migrations = pg_schema.MIGRATIONS
    other_hosts = True  # web hosts share it: a streaming answer's owner elsewhere may be alive

    def __init__(self, url: str, pool_size: int = POOL_SIZE) -> None:
        import psycopg  # here, not at module level: imported only when configured, after patching
        _green(psycopg)
        self._psycopg = psycopg
        self.url, self.pool_size = url, pool_size
        self._lock = real_lock()  # guards the lists only, never held across a query
        self._idle: list[Any] = []
        self._open = 0
        self._closed = False

    def _connect(self) -> Any:
        return self._psycopg.connect(self.url, autocommit=True, row_factory=_rows)

    def _take(self) -> Any:
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the store is closed")
                if self._idle:
                    return self._idle.pop()
                if self._open < self.pool_size:
                    self._open += 1
                    break
            time.sleep(WAIT_S)  # patched: a greenlet yields; a real thread sleeps
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def _give(self, raw: Any) -> None:
        idle = self._psycopg.pq.TransactionStatus.IDLE
        keep = not raw.closed and raw.info.transaction_status == idle
        with self._lock:
            if keep and not self._closed:
                self._idle.append(raw)
                return
            self._open -= 1
        raw.close()  # broken, or left mid-transaction: the next caller gets a fresh one

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection of the pool for the caller alone while the block runs."""
        raw = self._take()
        try:
            yield Connection(raw)
        finally:
            self._give(raw)

    def migrate(self) -> None:
        with self.connection() as db:
            pg_schema.migrate(db)

    @property
    def schema_version(self) -> int:
        with self.connection() as db:
            return pg_schema.version(db)

    @staticmethod
    def is_full(exc: BaseException) -> bool:
        """SQLSTATE 53100 disk_full: the server could not extend a file."""
        return getattr(exc, "sqlstate", None) == DISK_FULL

    def search(self, client_id: str, text: str, deadline: float) -> list[dict]:
        """This client's best matches for ``text`` (see search.py); PostgreSQL cancels the query at
        ``deadline`` (time.monotonic(): its statement_timeout) and this raises SearchTimeout."""
        query = fts.parse(text)
        if query is None or not client_id:
            return []
        with self.connection() as db:
            try:
                with db.transaction():
                    left_ms = int((deadline - time.monotonic()) * 1000)
                    if left_ms <= 0:
                        raise SearchTimeout()
                    db.execute("SELECT set_config('statement_timeout', %s, true)", (str(left_ms),))
                    return fts.search(db, fts.pg_ranked(query), query, client_id)
            except self._psycopg.Error as exc:
                if getattr(exc, "sqlstate", None) == QUERY_CANCELED:
                    raise SearchTimeout() from None
                raise

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
            self._open -= len(idle)
        for raw in idle:
            raw.close()
