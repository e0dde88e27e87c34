"""The Store: conversations and their message trees in one SQLite file."""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from .. import attachments as files
from ..concurrency import real_lock
from ..errors import ProtocolError
from . import search as fts, transfer, tree
from .guard import guarded as _guarded
from .schema import migrate
from .tree import valid as _valid
from .versions import Versions

PLACEHOLDER_TITLE = "New chat"
TITLE_CHARS = 60
BUSY_TIMEOUT_MS = 5000
FINISHED = ("stop", "length")

_CONV = "id, title, system, created_at, updated_at"


def new_id() -> str:
    """A random, URL-safe id of the shape this store hands out."""
    return uuid.uuid4().hex


def _title_from(content: str) -> str:
    """A short title from the first user message: whitespace collapsed, cut at a word."""
    text = " ".join(content.split())
    if len(text) <= TITLE_CHARS:
        return text or PLACEHOLDER_TITLE
    cut = text[:TITLE_CHARS - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= TITLE_CHARS // 2 else cut).rstrip() + "…"


_open_stores: set[str] = set()


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


class Store(Versions):
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
        self._token = new_id()
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
            migrate(self._db)

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
        out["attachments"] = json.loads(out["attachments"]) if out.get("attachments") else []
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
        conv = {"id": id or new_id(), "title": title or PLACEHOLDER_TITLE, "system": system or None,
                "created_at": now, "updated_at": now}
        with self._lock:
            self._check_room(client_id)
            self._db.execute(
                "INSERT INTO conversations (id, client_id, title, title_set, system, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conv["id"], client_id, conv["title"], bool(title), conv["system"], now, now))
        return conv

    def _check_room(self, client_id: str) -> None:
        """too_large when ``client_id`` already has as many conversations as the server keeps."""
        count = self._one("SELECT count(*) FROM conversations WHERE client_id = ?", (client_id,))[0]
        if self.max_conversations and count >= self.max_conversations:
            raise ProtocolError("too_large", f"you have {count} conversations, the most this server keeps "
                                             "for one client; delete some to start a new one")

    def owns(self, client_id: str | None, conv_id) -> bool:
        """Whether the conversation exists and belongs to ``client_id``."""
        with self._lock:
            return self._owned(client_id, conv_id)

    def get_conversation(self, client_id: str | None, conv_id) -> dict | None:
        """The conversation with its active path (oldest first, each message with its
        ``versions``), or None if not this client's."""
        with self._lock:
            if not self._owned(client_id, conv_id):
                return None
            conv = dict(self._one(f"SELECT {_CONV} FROM conversations WHERE id = ?", (conv_id,)))
            conv["messages"] = [self._message(r) for r in tree.path(self._db, conv_id)]
            tree.versions(self._db, conv_id, conv["messages"])
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

    def _insert(self, conv_id: str, parent_id: str | None, fields: dict) -> str:
        """Insert one message under ``parent_id`` and make it the active leaf; return its id."""
        message_id = new_id()
        self._db.execute(
            "INSERT INTO messages (id, conversation_id, parent_id, role, content, attachments, status, reason,"
            " usage, timings, owner, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (message_id, conv_id, parent_id, fields["role"], fields.get("content", ""),
             json.dumps(fields["attachments"], ensure_ascii=False) if fields.get("attachments") else None,
             fields["status"], fields.get("reason"),
             json.dumps(fields["usage"]) if fields.get("usage") is not None else None,
             json.dumps(fields["timings"]) if fields.get("timings") is not None else None,
             fields.get("owner"), fields.get("created_at") or time.time()))
        self._db.execute("UPDATE conversations SET active_id = ? WHERE id = ?", (message_id, conv_id))
        return message_id

    @_guarded
    def add_user_message(self, client_id: str | None, conv_id, content: str, attachments=None,
                         replaces: str | None = None) -> dict | None:
        """Append a user message to the active path, or with ``replaces`` add it as a new version
        of that user message (bad_message unless it is one on the active path). The first
        message also titles a conversation not yet named."""
        now = time.time()
        msg = {"conversation_id": conv_id, "role": "user", "content": content, "status": "complete",
               "reason": None, "usage": None, "timings": None, "created_at": now,
               "attachments": files.clean(attachments)}
        with self._lock:
            if not self._owned(client_id, conv_id):
                return None
            count = self._one("SELECT count(*) FROM messages WHERE conversation_id = ?", (conv_id,))[0]
            if self.max_messages and count + 2 > self.max_messages:  # room for the question and its answer
                raise ProtocolError("too_large", f"this conversation has reached {count} messages, the most "
                                                 "this server keeps in one; start a new conversation")
            with self._transaction():
                parent = (self._on_path(conv_id, replaces, "user")["parent_id"] if replaces is not None
                          else tree.active_leaf(self._db, conv_id))
                msg["id"], msg["parent_id"] = self._insert(conv_id, parent, msg), parent
                self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
                self._db.execute("UPDATE conversations SET title = ?, title_set = 1 WHERE id = ? AND title_set = 0",
                                 (_title_from(content), conv_id))
        return msg

    @_guarded
    def start_assistant(self, conv_id: str, parent_id: str | None = None) -> str:
        """Add an empty 'streaming' assistant message under ``parent_id`` (default: the active
        leaf), make it active and return its id."""
        with self._lock, self._transaction():
            parent = parent_id or tree.active_leaf(self._db, conv_id)
            return self._insert(conv_id, parent, {"role": "assistant", "status": "streaming", "owner": self._owner})

    @property
    def _owner(self) -> str:
        """Who writes a streaming answer: this Store in this process on this host."""
        return f"{socket.gethostname()}:{os.getpid()}:{self._token}"

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
    def forget_client(self, client_id: str) -> int:
        """Delete every conversation of ``client_id``; return how many."""
        with self._lock:
            return self._db.execute("DELETE FROM conversations WHERE client_id = ?", (client_id,)).rowcount

    def expire_clients(self, prefix: str, idle_s: float) -> int:
        """Delete conversations of clients named ``prefix...`` idle for ``idle_s``; return how many."""
        with self._lock:
            return self._db.execute("DELETE FROM conversations WHERE substr(client_id, 1, ?) = ?"
                                    " AND updated_at < ?", (len(prefix), prefix, time.time() - idle_s)).rowcount

    def history(self, conv_id: str, upto: str | None = None, limit: int | None = None) -> list[dict]:
        """The prompt messages: the system prompt (if any), then the non-empty turns of the active
        path (or of the path ending at ``upto``; none for ``""``), attachments as fenced blocks; at
        most the newest ``limit`` turns when given."""
        with self._lock:
            conv = self._one("SELECT system FROM conversations WHERE id = ?", (conv_id,))
            rows = tree.path(self._db, conv_id, upto, limit)
        out = [{"role": "system", "content": conv["system"]}] if conv is not None and conv["system"] else []
        for row in rows:
            if row["role"] == "assistant" and row["content"] == "":
                continue
            attached = json.loads(row["attachments"]) if row["attachments"] else None
            out.append({"role": row["role"], "content": files.with_attachments(row["content"], attached)})
        return out

    def search(self, client_id: str | None, text: str) -> list[dict]:
        """This client's messages that match ``text``, best first (see search.py)."""
        with self._lock:
            return fts.search(self._db, client_id, text)

    @_guarded
    def import_conversation(self, client_id: str, body, max_content_chars: int) -> str:
        """Create a conversation of ``client_id`` from an export or a ``messages`` list; its id."""
        data = transfer.parse_import(body, max_content_chars, self.max_messages)
        first = next((m["content"] for m in data["messages"] if m["role"] == "user"), "")
        conv_id, now = new_id(), time.time()
        created = data["created_at"] or now
        with self._lock, self._transaction():
            self._check_room(client_id)
            self._db.execute(
                "INSERT INTO conversations (id, client_id, title, title_set, system, created_at, updated_at)"
                " VALUES (?, ?, ?, 1, ?, ?, ?)",
                (conv_id, client_id, data["title"] or (_title_from(first) if first else PLACEHOLDER_TITLE),
                 data["system"], created, now))
            parent = None
            for msg in data["messages"]:
                parent = self._insert(conv_id, parent, {**msg, "created_at": msg["created_at"] or now})
        return conv_id

    def export(self, client_id: str | None, conv_id, fmt: str) -> tuple[str, str, str] | None:
        """(body, mimetype, filename) of the conversation as Markdown or JSON, or None."""
        if fmt not in ("md", "json"):
            raise ValueError(f"unknown export format {fmt!r}")
        conv = self.get_conversation(client_id, conv_id)
        if conv is None:
            return None
        filename = transfer.filename(conv, fmt)
        if fmt == "json":
            return json.dumps(conv, ensure_ascii=False, indent=2) + "\n", "application/json", filename
        return transfer.markdown(conv), "text/markdown", filename

