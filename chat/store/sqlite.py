"""The SQLite backend: one file, one connection shared under a real lock."""
from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import SearchTimeout, StoreBusy
from ..concurrency import real_lock
from . import search as fts
from .schema import MIGRATIONS, index_cjk, migrate

log = logging.getLogger("chat.store")
BUSY_TIMEOUT_MS = 5000
PROGRESS_STEPS = 2000  # virtual machine steps between two looks at a search's deadline


class SQLite:
    """One connection to one file; ``connection()`` lends it (itself: a ``backend.Connection``)
    to one caller at a time."""

    kind = "sqlite"
    migrations = MIGRATIONS
    other_hosts = False  # a file: a streaming answer's owner on another host is an old name of this one
    mark = "?"
    lock_rows = ""  # BEGIN IMMEDIATE already serializes writers

    def __init__(self, path: str, max_mb: int = 0) -> None:
        self.path = path
        if path != ":memory:":
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the newest folder: only ours
            if not path.startswith("file:"):
                os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # a new database readable by us alone
        # A real lock, even after monkey-patching: no statement yields to the hub while it is
        # held, and real engine threads must be able to wait on it without a hub of their own.
        self._lock = real_lock()
        self.raw = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.raw.row_factory = sqlite3.Row
        self.raw.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self.raw.execute("PRAGMA journal_mode = WAL")
        self.raw.execute("PRAGMA synchronous = NORMAL")
        self.raw.execute("PRAGMA foreign_keys = ON")
        if max_mb:  # SQLite refuses to grow past this, exactly as on a full disk
            page = self.raw.execute("PRAGMA page_size").fetchone()[0]
            self.raw.execute(f"PRAGMA max_page_count = {max_mb * 2**20 // page}")
        self.execute, self.executemany = self.raw.execute, self.raw.executemany

    @contextmanager
    def connection(self) -> Iterator[SQLite]:
        """The connection, for the caller alone while the block runs. A database another process
        kept locked past the busy timeout is StoreBusy (``overloaded``), not an internal error."""
        with self._lock:
            try:
                yield self
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    raise
                log.warning("the database stayed locked past %d ms: %s", BUSY_TIMEOUT_MS, exc)
                raise StoreBusy() from None

    @staticmethod
    def lock(key: str) -> None:
        """Nothing: BEGIN IMMEDIATE already made the transaction the only writer."""

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE: take the write lock up front, so another process's writer makes
        us wait on busy_timeout instead of failing to upgrade a read lock."""
        self.raw.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self.raw.in_transaction:  # SQLITE_FULL may already have rolled it back
                self.raw.execute("ROLLBACK")
            raise
        self.raw.execute("COMMIT")

    def migrate(self) -> None:
        """Bring the schema up to date, inside one write transaction."""
        with self.connection(), self.transaction():
            migrate(self.raw)

    @property
    def schema_version(self) -> int:
        with self.connection():
            return self.raw.execute("PRAGMA user_version").fetchone()[0]

    @staticmethod
    def is_full(exc: BaseException) -> bool:
        """SQLite's "database or disk is full" (a real disk, or max_page_count)."""
        return (isinstance(exc, sqlite3.OperationalError)
                and getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL)

    def reindex(self, message_id: str) -> None:
        """Bring the message's entry in the CJK index up to date (the word index has triggers)."""
        row = self.raw.execute(f"SELECT seq, status, substr(content, 1, {fts.INDEXED_CHARS}) AS text"
                               " FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is not None:
            index_cjk(self.raw, row["seq"], row["status"], row["text"])

    def search(self, client_id: str, text: str, deadline: float) -> list[dict]:
        """This client's best matches for ``text`` (see search.py), on a read-only connection of its
        own (WAL lets it read beside the writer, and the shared connection's lock stays free),
        interrupted at ``deadline`` (time.monotonic()) with SearchTimeout."""
        query = fts.parse(text)
        if query is None or not client_id:
            return []
        if self.path == ":memory:":  # nothing else can open it: the shared connection, under its lock
            with self.connection():
                return self._search(self.raw, query, client_id, deadline)
        reader = sqlite3.connect(Path(self.path).resolve().as_uri() + "?mode=ro", uri=True,
                                 check_same_thread=False)
        try:
            reader.row_factory = sqlite3.Row
            reader.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            return self._search(reader, query, client_id, deadline)
        finally:
            reader.close()

    @staticmethod
    def _search(conn: sqlite3.Connection, query: fts.Query, client_id: str, deadline: float) -> list[dict]:
        if time.monotonic() > deadline:  # it waited for a thread that long
            raise SearchTimeout()
        conn.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_STEPS)
        try:
            return fts.search(conn, fts.sqlite_ranked(query), query, client_id)
        except sqlite3.OperationalError as exc:
            if time.monotonic() > deadline:  # the progress handler interrupted it
                raise SearchTimeout() from None
            raise exc
        finally:
            conn.set_progress_handler(None, 0)

    def close(self) -> None:
        with self._lock:
            self.raw.close()
