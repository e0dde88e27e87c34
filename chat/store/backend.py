"""What the Store needs from a database: the ``StoreBackend`` and ``Connection`` interfaces
(``sqlite.SQLite`` and ``postgres.PostgreSQL`` implement them; ``conversations.backend_for`` picks one).

A backend owns its dialect. The store's SQL is written once where the dialects agree, with each
connection's own parameter ``mark`` (``?`` in SQLite, ``%s`` in psycopg) put in by the caller; where
they differ (locks, search, migrations, the CJK index) the backend does the work itself.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

Row = Any  # a row by column name and by position (sqlite3.Row, postgres.Row)


class Cursor(Protocol):
    """What a statement gives back."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Row:
        """The next row, or None."""

    def fetchall(self) -> list[Row]: ...

    def __iter__(self) -> Iterator[Row]: ...


class Executor(Protocol):
    """Anything that runs a statement: a ``Connection``, or a backend's own driver connection."""

    def execute(self, statement: str, args: Sequence[Any] = (), /) -> Cursor:
        """Run one statement (autocommit outside a transaction)."""


class Connection(Executor, Protocol):
    """One connection, lent to one caller at a time (``StoreBackend.connection``)."""

    mark: str  # the parameter placeholder of the dialect
    lock_rows: str  # appended to a SELECT in a transaction: lock the rows read until it ends

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]], /) -> Any:
        """Run one statement once per row of arguments."""

    def transaction(self) -> AbstractContextManager[object]:
        """A transaction for the block: committed when it ends, rolled back when it raises."""

    def lock(self, key: str) -> None:
        """Hold a lock named ``key`` until the transaction ends: a check-then-insert (a quota) stays
        true for one writer at a time, across processes (and hosts, where the database is shared)."""

    def reindex(self, message_id: str) -> None:
        """Bring the search indexes up to date with the message's text and status, where the
        database does not do it itself."""


class StoreBackend(Protocol):
    """A database the Store keeps conversations in (``SQLite``, ``PostgreSQL``)."""

    kind: str  # "sqlite" or "postgresql": for logs and tests, never for branching
    migrations: list  # its own append-only schema steps; schema_version reaches their count
    other_hosts: bool  # whether writers on other hosts may share it (see liveness.local_alive)

    def connection(self) -> AbstractContextManager[Connection]:
        """A connection for the caller alone while the block runs."""

    def migrate(self) -> None:
        """Bring the schema up to date (several processes may start at once)."""

    @property
    def schema_version(self) -> int:
        """The number of migrations the database has seen."""

    def is_full(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the disk (or the configured cap) is full."""

    def search(self, client_id: str, text: str, deadline: float) -> list[dict]:
        """This client's best matches for ``text`` (search.py), SearchTimeout past ``deadline``
        (time.monotonic())."""

    def close(self) -> None:
        """Close every connection."""


def marks(db: Connection, count: int) -> str:
    """``count`` parameter placeholders of ``db``'s dialect, comma separated (a VALUES or IN list)."""
    return ", ".join([db.mark] * count)



class Host(Protocol):
    """What the Store's mixins (versions.py, options.py) use of the Store they are mixed into."""

    def _conn(self) -> AbstractContextManager[Connection]: ...

    @property
    def _owner(self) -> str: ...

    def get_conversation(self, client_id: str | None, conv_id: str) -> dict | None: ...

    def start_assistant(self, conv_id: str, parent_id: str | None = None) -> str: ...

    def finish_assistant(self, message_id: str, content: str, reason: str,
                         usage: dict | None = None, timings: dict | None = None) -> None: ...
