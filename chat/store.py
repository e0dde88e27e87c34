"""Conversations and messages in one SQLite file: the only module that touches sqlite3."""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import sqlite3
import time
import unicodedata
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from .concurrency import real_lock
from .errors import ProtocolError, StorageFull

log = logging.getLogger(__name__)

PLACEHOLDER_TITLE = "New chat"
TITLE_CHARS = 60
BUSY_TIMEOUT_MS = 5000
FINISHED = ("stop", "length")
_ID = re.compile(r"[0-9a-f]{32}")

# Each entry moves the schema from version N to N + 1; append, never edit.
MIGRATIONS = [
    (
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            title TEXT NOT NULL,
            title_set INTEGER NOT NULL DEFAULT 0,
            system TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        "CREATE INDEX conversations_by_client ON conversations (client_id, updated_at)",
        """CREATE TABLE messages (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL,
            reason TEXT,
            usage TEXT,
            timings TEXT,
            owner TEXT,
            created_at REAL NOT NULL)""",
        "CREATE INDEX messages_by_conversation ON messages (conversation_id, seq)",
        "CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming'",
    ),
]

_CONV = "id, title, system, created_at, updated_at"
_MSG = "id, conversation_id, role, content, status, reason, usage, timings, created_at"


def new_id() -> str:
    """A random, URL-safe id of the shape this store hands out."""
    return uuid.uuid4().hex


_new_id = new_id


def _valid(*ids) -> bool:
    """Whether every value has the shape of an id this store hands out."""
    return all(isinstance(i, str) and _ID.fullmatch(i) for i in ids)


def _title_from(content: str) -> str:
    """A short title from the first user message: whitespace collapsed, cut at a word."""
    text = " ".join(content.split())
    if len(text) <= TITLE_CHARS:
        return text or PLACEHOLDER_TITLE
    cut = text[:TITLE_CHARS - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= TITLE_CHARS // 2 else cut).rstrip() + "…"


def _slug(title: str) -> str:
    """An ASCII file-name stem for a title."""
    ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")[:50].strip("-") or "conversation"


def _iso(ts: float) -> str:
    """A UNIX time as a readable UTC date."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


_open_stores: set[str] = set()


def _guarded(method):
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


def _alive(owner: str | None) -> bool:
    """Whether the Store that started a streaming answer may still be writing it: open in
    this process, or in another live process on this host (a sibling gunicorn worker)."""
    host, pid, token = ((owner or "").rsplit(":", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return token in _open_stores
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a killed worker whose parent died too may linger as a zombie nobody reaps
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Store:
    """Conversations of many clients; safe to share between greenlets and OS threads."""

    def __init__(self, path: str | os.PathLike, max_conversations: int = 0, max_messages: int = 0,
                 max_mb: int = 0):
        path = str(path)
        self.max_conversations, self.max_messages = max_conversations, max_messages
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # A real lock, even after monkey-patching: no statement yields to the hub while it is
        # held, and real engine threads must be able to wait on it without a hub of their own.
        self._lock = real_lock()
        self._token = _new_id()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        if max_mb:  # SQLite refuses to grow past this, exactly as on a full disk
            page = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count = {max_mb * 2**20 // page}")
        self._migrate()
        self.recover()
        _open_stores.add(self._token)

    def close(self) -> None:
        """Close the database connection."""
        _open_stores.discard(self._token)
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        """Bring the schema up to date, inside one write transaction."""
        with self._lock, self._transaction():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            for number, statements in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in statements:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {number}")

    @property
    def schema_version(self) -> int:
        """The schema version stored in the file."""
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    @contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE: take the write lock up front, so another process's writer makes
        us wait on busy_timeout instead of failing to upgrade a read lock."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:  # SQLITE_FULL may already have rolled it back
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _one(self, sql: str, args=()) -> sqlite3.Row | None:
        """The first row of a query, or None."""
        return self._db.execute(sql, args).fetchone()

    def _owned(self, client_id, conv_id) -> bool:
        """``owns`` for a caller that already holds the lock."""
        return (_valid(conv_id) and isinstance(client_id, str) and client_id != "" and
                self._one("SELECT 1 FROM conversations WHERE id = ? AND client_id = ?",
                          (conv_id, client_id)) is not None)

    @staticmethod
    def _message(row: sqlite3.Row) -> dict:
        """A message row as a dict, with its JSON columns decoded."""
        out = dict(row)
        for key in ("usage", "timings"):
            out[key] = json.loads(out[key]) if out[key] else None
        return out

    def recover(self) -> int:
        """Mark answers left 'streaming' by a dead process as 'interrupted'; return how many."""
        with self._lock, self._transaction():
            rows = self._db.execute("SELECT id, owner FROM messages WHERE status = 'streaming'").fetchall()
            stale = [(r["id"],) for r in rows if not _alive(r["owner"])]
            self._db.executemany(
                "UPDATE messages SET status = 'interrupted', reason = 'error' WHERE id = ?", stale)
        return len(stale)

    @_guarded
    def create_conversation(self, client_id: str, system: str | None = None,
                            title: str | None = None, id: str | None = None) -> dict:
        """Start an empty conversation for ``client_id`` (under ``id`` when the caller chose it)."""
        now = time.time()
        conv = {"id": id or _new_id(), "title": title or PLACEHOLDER_TITLE, "system": system or None,
                "created_at": now, "updated_at": now}
        with self._lock:
            count = self._one("SELECT count(*) FROM conversations WHERE client_id = ?", (client_id,))[0]
            if self.max_conversations and count >= self.max_conversations:
                raise ProtocolError("too_large", f"you have {count} conversations, the most this server keeps "
                                                 "for one client; delete some to start a new one")
            self._db.execute(
                "INSERT INTO conversations (id, client_id, title, title_set, system, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conv["id"], client_id, conv["title"], bool(title), conv["system"], now, now))
        return conv

    def owns(self, client_id: str | None, conv_id) -> bool:
        """Whether the conversation exists and belongs to ``client_id``."""
        with self._lock:
            return self._owned(client_id, conv_id)

    def get_conversation(self, client_id: str | None, conv_id) -> dict | None:
        """The conversation with its messages (oldest first), or None if not this client's."""
        with self._lock:
            if not self._owned(client_id, conv_id):
                return None
            conv = dict(self._one(f"SELECT {_CONV} FROM conversations WHERE id = ?", (conv_id,)))
            rows = self._db.execute(
                f"SELECT {_MSG} FROM messages WHERE conversation_id = ? ORDER BY seq", (conv_id,)).fetchall()
        conv["messages"] = [self._message(r) for r in rows]
        return conv

    def list_conversations(self, client_id: str | None) -> list[dict]:
        """This client's conversations, most recently updated first, without messages."""
        if not client_id:
            return []
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_CONV} FROM conversations WHERE client_id = ?"
                " ORDER BY updated_at DESC, rowid DESC", (client_id,)).fetchall()
        return [dict(r) for r in rows]

    @_guarded
    def rename(self, client_id: str | None, conv_id, title: str) -> bool:
        """Set the title; False if the conversation is not this client's."""
        with self._lock:
            if not self._owned(client_id, conv_id):
                return False
            self._db.execute("UPDATE conversations SET title = ?, title_set = 1, updated_at = ? WHERE id = ?",
                             (title, time.time(), conv_id))
        return True

    @_guarded
    def delete(self, client_id: str | None, conv_id) -> bool:
        """Delete the conversation and its messages; False if it is not this client's."""
        if not client_id or not _valid(conv_id):
            return False
        with self._lock:
            cur = self._db.execute("DELETE FROM conversations WHERE id = ? AND client_id = ?",
                                   (conv_id, client_id))
        return cur.rowcount > 0

    @_guarded
    def add_user_message(self, client_id: str | None, conv_id, content: str) -> dict | None:
        """Append a user message; the first one also titles a conversation not yet named."""
        now = time.time()
        msg = {"id": _new_id(), "conversation_id": conv_id, "role": "user", "content": content,
               "status": "complete", "reason": None, "usage": None, "timings": None, "created_at": now}
        with self._lock:
            if not self._owned(client_id, conv_id):
                return None
            count = self._one("SELECT count(*) FROM messages WHERE conversation_id = ?", (conv_id,))[0]
            if self.max_messages and count + 2 > self.max_messages:  # room for the question and its answer
                raise ProtocolError("too_large", f"this conversation has reached {count} messages, the most "
                                                 "this server keeps in one; start a new conversation")
            with self._transaction():
                self._db.execute(
                    "INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
                    " VALUES (?, ?, 'user', ?, 'complete', ?)", (msg["id"], conv_id, content, now))
                self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
                self._db.execute("UPDATE conversations SET title = ?, title_set = 1 WHERE id = ? AND title_set = 0",
                                 (_title_from(content), conv_id))
        return msg

    @_guarded
    def start_assistant(self, conv_id: str) -> str:
        """Add an empty 'streaming' assistant message and return its id."""
        message_id = _new_id()
        with self._lock:
            self._db.execute(
                "INSERT INTO messages (id, conversation_id, role, status, owner, created_at)"
                " VALUES (?, ?, 'assistant', 'streaming', ?, ?)",
                (message_id, conv_id, f"{socket.gethostname()}:{os.getpid()}:{self._token}", time.time()))
        return message_id

    @_guarded
    def save_partial(self, message_id: str, content: str) -> None:
        """Checkpoint the text streamed so far, so a crash loses little of it."""
        with self._lock:
            self._db.execute("UPDATE messages SET content = ? WHERE id = ? AND status = 'streaming'",
                             (content, message_id))

    @_guarded
    def finish_assistant(self, message_id: str, content: str, reason: str,
                         usage: dict | None = None, timings: dict | None = None) -> None:
        """Store the final text; 'complete' for stop/length, otherwise 'partial'."""
        now = time.time()
        with self._lock, self._transaction():
            self._db.execute(
                "UPDATE messages SET content = ?, status = ?, reason = ?, usage = ?, timings = ?, owner = NULL"
                " WHERE id = ?",
                (content, "complete" if reason in FINISHED else "partial", reason,
                 json.dumps(usage) if usage is not None else None,
                 json.dumps(timings) if timings is not None else None, message_id))
            self._db.execute(
                "UPDATE conversations SET updated_at = ?"
                " WHERE id = (SELECT conversation_id FROM messages WHERE id = ?)", (now, message_id))

    @_guarded
    def drop_last_assistant(self, client_id: str | None, conv_id) -> dict | None:
        """For regenerate: delete a trailing assistant message and return the last user message."""
        with self._lock:
            if not self._owned(client_id, conv_id):
                return None
            with self._transaction():
                last = self._one("SELECT seq, role FROM messages WHERE conversation_id = ?"
                                 " ORDER BY seq DESC LIMIT 1", (conv_id,))
                if last is not None and last["role"] == "assistant":
                    self._db.execute("DELETE FROM messages WHERE seq = ?", (last["seq"],))
                row = self._one(f"SELECT {_MSG} FROM messages WHERE conversation_id = ? AND role = 'user'"
                                " ORDER BY seq DESC LIMIT 1", (conv_id,))
        return self._message(row) if row is not None else None

    @_guarded
    def forget_client(self, client_id: str) -> int:
        """Delete every conversation of ``client_id``; return how many."""
        with self._lock:
            return self._db.execute("DELETE FROM conversations WHERE client_id = ?", (client_id,)).rowcount

    def expire_clients(self, prefix: str, idle_s: float) -> int:
        """Delete conversations of clients named ``prefix...`` idle for ``idle_s``; return how many."""
        with self._lock:
            return self._db.execute("DELETE FROM conversations WHERE substr(client_id, 1, ?) = ?"
                                    " AND updated_at < ?", (len(prefix), prefix, time.time() - idle_s)).rowcount

    def history(self, conv_id: str, limit: int | None = None) -> list[dict]:
        """The prompt messages: the system prompt (if any), then the non-empty turns in order (the newest ``limit``)."""
        with self._lock:
            conv = self._one("SELECT system FROM conversations WHERE id = ?", (conv_id,))
            rows = self._db.execute(
                "SELECT role, content FROM messages WHERE conversation_id = ?"
                " AND NOT (role = 'assistant' AND content = '') ORDER BY seq DESC LIMIT ?",
                (conv_id, -1 if limit is None else limit)).fetchall()
        out = [{"role": "system", "content": conv["system"]}] if conv is not None and conv["system"] else []
        return out + [dict(r) for r in reversed(rows)]

    def export(self, client_id: str | None, conv_id, fmt: str) -> tuple[str, str, str] | None:
        """(body, mimetype, filename) of the conversation as Markdown or JSON, or None."""
        if fmt not in ("md", "json"):
            raise ValueError(f"unknown export format {fmt!r}")
        conv = self.get_conversation(client_id, conv_id)
        if conv is None:
            return None
        filename = f"{_slug(conv['title'])}-{conv['id'][:8]}.{fmt}"
        if fmt == "json":
            return json.dumps(conv, ensure_ascii=False, indent=2) + "\n", "application/json", filename
        return _markdown(conv), "text/markdown", filename


def _markdown(conv: dict) -> str:
    """The conversation as a readable Markdown document."""
    parts = [f"# {conv['title']}", f"_Created {_iso(conv['created_at'])}_"]
    if conv["system"]:
        parts.append(f"**System:** {conv['system']}")
    for msg in conv["messages"]:
        parts += [f"## {msg['role'].capitalize()}", msg["content"]]
        if msg["role"] == "assistant" and msg["status"] != "complete":
            parts.append(f"_(incomplete answer: {msg['reason'] or msg['status']})_")
    return "\n\n".join(parts) + "\n"
