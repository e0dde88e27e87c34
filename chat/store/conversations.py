"""The Store: conversations and their message trees, in SQLite or PostgreSQL (the backend)."""
from __future__ import annotations

import functools
import json
import os
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

from .. import attachments as files
from ..errors import ProtocolError
from . import cjk, liveness, transfer, tree
from .backend import Connection, StoreBackend, marks
from .disk_full import guarded as _guarded
from .options import CONVERSATION_COLUMNS as _CONV, Options, conversation as _conversation
from .presets import Presets
from .sharing import Sharing
from .trash import Trash
from .tree import message as _message, owned as _owned, valid as _valid
from .versions import Versions

PLACEHOLDER_TITLE = "New chat"
TITLE_CHARS = 60
FINISHED = ("stop", "length", "edited")  # stored 'complete' (an answer its user rewrote: "edited")
SEARCH_BUDGET_S = 2.0  # a search's time when the caller sets none


def new_id() -> str:
    """A random, URL-safe id of the shape this store hands out."""
    return uuid.uuid4().hex


def _title_from(content: str) -> str:
    """A short title from the first user message: whitespace collapsed, cut at a word."""
    text = transfer.clean_title(content)
    if len(text) <= TITLE_CHARS:
        return text or PLACEHOLDER_TITLE
    cut = text[:TITLE_CHARS - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= TITLE_CHARS // 2 else cut).rstrip() + "…"


def _size(message: dict) -> int:
    """The characters a message adds to its conversation's size: its text, its thinking and its attachments."""
    return (len(message.get("content") or "") + len(message.get("reasoning") or "")
            + files.chars(message.get("attachments") or []))


def backend_for(target: str, max_mb: int = 0) -> StoreBackend:
    """The backend CHAT_DB names: a postgresql:// (or postgres://) URL, else an SQLite file (``max_mb``:
    its cap in MiB, 0 for none)."""
    from .postgres import PostgreSQL, is_url
    if is_url(target):
        return PostgreSQL(target)
    from .sqlite import SQLite
    return SQLite(target, max_mb)


class Store(Versions, Options, Sharing, Presets, Trash):
    """Conversations of many clients; safe to share between greenlets and OS threads."""

    def __init__(self, path: str | os.PathLike, max_conversations: int = 0, max_messages: int = 0,
                 max_mb: int = 0, alive: Callable[[str | None], bool] | None = None,
                 max_mb_per_address: int = 0) -> None:
        """``path``: an SQLite file (``:memory:`` too) or a postgresql:// URL; ``max_mb`` is
        SQLite's only; ``max_mb_per_address``: what conversations started from one address may
        hold (new ones past it are refused), 0 for no limit. ``alive(owner)`` says whether the
        writer of a streaming answer may still be at work (default: liveness.local_alive; see recover)."""
        self.max_conversations, self.max_messages = max_conversations, max_messages
        self.max_chars_per_address = max_mb_per_address * 2**20
        self._backend = backend_for(str(path), max_mb)
        self._alive = alive or functools.partial(liveness.local_alive, other_hosts=self._backend.other_hosts)
        self._token = new_id()
        self._backend.migrate()
        self.recover()
        liveness.open_stores.add(self._token)

    @property
    def kind(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._backend.kind

    @property
    def migrations(self) -> list:
        """The backend's list of migrations (schema_version reaches its length)."""
        return self._backend.migrations

    def _conn(self) -> AbstractContextManager[Connection]:
        """A connection for one operation: SQLite's one, under its lock, or one of the pool."""
        return self._backend.connection()

    def close(self) -> None:
        """Close the database connection(s)."""
        liveness.open_stores.discard(self._token)
        self._backend.close()

    @property
    def schema_version(self) -> int:
        """The schema version stored in the database."""
        return self._backend.schema_version

    def recover(self) -> int:
        """Mark answers left 'streaming' by a writer that ``alive`` says is gone as
        'interrupted'; return how many. Cheap enough to call periodically: one indexed read,
        ``alive`` asked once per owner, and a write only for what it finds stale."""
        with self._conn() as db:
            rows = db.execute("SELECT id, owner FROM messages WHERE status = 'streaming'").fetchall()
            verdicts = {owner: self._alive(owner) for owner in {r["owner"] for r in rows}}
            # The owner in the WHERE: an answer finished or reopened by someone else meanwhile stays.
            stale = [(r["id"], r["owner"]) for r in rows if not verdicts[r["owner"]]]
            if stale:
                with db.transaction():
                    db.executemany(f"UPDATE messages SET status = 'interrupted', reason = 'error' WHERE id = {db.mark}"
                                   f" AND status = 'streaming' AND coalesce(owner, '') = {db.mark}",
                                   [(i, owner or "") for i, owner in stale])
                    for message_id, _ in stale:
                        db.reindex(message_id)
        return len(stale)

    @_guarded
    def create_conversation(self, client_id: str, system: str | None = None, title: str | None = None,
                            id: str | None = None, params: dict | None = None, model: str | None = None,
                            address: str | None = None) -> dict:
        """Start an empty conversation for ``client_id`` (under ``id`` when the caller chose it), with
        the sampling ``params`` and ``model`` its turns use; ``address`` (the client's) is charged
        for what it will hold."""
        now = time.time()
        conv = {"id": id or new_id(), "title": title or PLACEHOLDER_TITLE, "system": system or None,
                "created_at": now, "updated_at": now, "pinned": False, "params": params or {},
                "model": model or None}
        with self._conn() as db, db.transaction():
            self._check_room(db, client_id, address, len(system or ""))
            db.execute(
                "INSERT INTO conversations (id, client_id, title, title_set, renamed, system, params, model,"
                f" created_at, updated_at, address, size) VALUES ({marks(db, 12)})",
                (conv["id"], client_id, conv["title"], int(bool(title)), int(bool(title)), conv["system"],
                 json.dumps(params) if params else None, conv["model"], now, now, address, len(system or "")))
        return conv

    def _check_room(self, db: Connection, client_id: str, address: str | None = None, adding: int = 0) -> None:
        """too_large when ``client_id`` already has as many conversations as the server keeps, or
        the conversations started from ``address`` (whatever their client) hold its share of the
        storage, ``adding`` characters included; the caller's transaction keeps it true until its
        insert (on PostgreSQL: a lock per client and per address)."""
        db.lock(client_id)
        count = db.execute(f"SELECT count(*) FROM conversations WHERE client_id = {db.mark} AND deleted_at IS NULL",
                           (client_id,)).fetchone()[0]
        if self.max_conversations and count >= self.max_conversations:
            raise ProtocolError("too_large", f"you have {count} conversations, the most this server keeps "
                                             "for one client; delete some to start a new one")
        if address is None or not self.max_chars_per_address:
            return
        db.lock("@" + address)
        held = db.execute(f"SELECT coalesce(sum(size), 0) FROM conversations WHERE address = {db.mark}",
                          (address,)).fetchone()[0]
        if held + adding > self.max_chars_per_address:
            raise ProtocolError("too_large", f"conversations from your address hold {held / 2**20:.1f} MiB of "
                                             "text, the most this server keeps for one address; delete some "
                                             "to start a new one")

    def owns(self, client_id: str | None, conv_id: str | None) -> bool:
        """Whether the conversation exists and belongs to ``client_id``."""
        with self._conn() as db:
            return _owned(db, client_id, conv_id)

    def get_conversation(self, client_id: str | None, conv_id: str) -> dict | None:
        """The conversation with its active path (oldest first, each message with its
        ``versions``), or None if not this client's."""
        with self._conn() as db:
            if not _owned(db, client_id, conv_id):
                return None
            conv = _conversation(db.execute(f"SELECT {_CONV} FROM conversations WHERE id = {db.mark}",
                                            (conv_id,)).fetchone())
            conv["messages"] = [_message(r) for r in tree.path(db, conv_id)]
            tree.versions(db, conv_id, conv["messages"])
        return conv

    def list_conversations(self, client_id: str | None, view: str = "main") -> list[dict]:
        """This client's conversations without messages: pinned ones first, then most recently
        updated first (a new message updates; renaming, pinning and settings do not). ``view``:
        "main" (neither archived nor in the trash), "archived", or "trash" (last deleted first)."""
        if not client_id:
            return []
        where, order = {"main": ("deleted_at IS NULL AND archived = 0", "pinned DESC, updated_at DESC"),
                        "archived": ("deleted_at IS NULL AND archived = 1", "updated_at DESC"),
                        "trash": ("deleted_at IS NOT NULL", "deleted_at DESC")}[view]
        with self._conn() as db:
            rows = db.execute(
                f"SELECT {_CONV} FROM conversations WHERE client_id = {db.mark} AND {where}"
                f" ORDER BY {order}, rowid DESC", (client_id,)).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, client_id: str | None, conv_id: str, title: str) -> bool:
        """Set the title, keeping the conversation's place; False if it is not this client's."""
        return self.update(client_id, conv_id, {"title": title}) is not None

    @_guarded
    def delete(self, client_id: str | None, conv_id: str) -> bool:
        """Delete the conversation and its messages; False if it is not this client's."""
        if not client_id or not _valid(conv_id):
            return False
        with self._conn() as db:
            cur = db.execute(f"DELETE FROM conversations WHERE id = {db.mark} AND client_id = {db.mark}",
                             (conv_id, client_id))
        return cur.rowcount > 0

    def _insert(self, db: Connection, conv_id: str, parent_id: str | None, fields: dict) -> str:
        """Insert one message under ``parent_id`` and make it the active leaf; return its id."""
        message_id = new_id()
        db.execute(
            "INSERT INTO messages (id, conversation_id, parent_id, role, content, attachments, status, reason,"
            f" usage, timings, owner, created_at, reasoning) VALUES ({marks(db, 13)})",
            (message_id, conv_id, parent_id, fields["role"], fields.get("content", ""),
             json.dumps(fields["attachments"], ensure_ascii=False) if fields.get("attachments") else None,
             fields["status"], fields.get("reason"),
             json.dumps(fields["usage"]) if fields.get("usage") is not None else None,
             json.dumps(fields["timings"]) if fields.get("timings") is not None else None,
             fields.get("owner"), fields.get("created_at") or time.time(), fields.get("reasoning") or None))
        if fields["status"] != "streaming" and cjk.has_cjk(fields.get("content", "")):
            db.reindex(message_id)
        db.execute(f"UPDATE conversations SET active_id = {db.mark}, size = size + {db.mark} WHERE id = {db.mark}",
                   (message_id, _size(fields), conv_id))
        return message_id

    @_guarded
    def add_user_message(self, client_id: str | None, conv_id: str, content: str,
                         attachments: list | None = None, replaces: str | None = None,
                         retitle: bool = True) -> dict | None:
        """Append a user message to the active path, or with ``replaces`` add it as a new version
        of that user message (bad_message unless it is one on the active path). The first
        message also titles a conversation not yet named; a new version of it renames one whose
        user did not name it, unless ``retitle`` is False (CHAT_TITLES: one title per conversation)."""
        now = time.time()
        msg = {"conversation_id": conv_id, "role": "user", "content": content, "status": "complete",
               "reason": None, "usage": None, "timings": None, "created_at": now,
               "attachments": files.clean(attachments)}
        with self._conn() as db:
            if not _owned(db, client_id, conv_id):
                return None
            with db.transaction():
                leaf = tree.active_leaf(db, conv_id)  # first: it locks the conversation on PostgreSQL
                count = db.execute(f"SELECT count(*) FROM messages WHERE conversation_id = {db.mark}",
                                   (conv_id,)).fetchone()[0]
                if self.max_messages and count + 2 > self.max_messages:  # room for the question and its answer
                    raise ProtocolError("too_large", f"this conversation has reached {count} messages, the most "
                                                     "this server keeps in one; start a new conversation")
                parent = tree.on_path(db, conv_id, replaces, "user")["parent_id"] if replaces is not None else leaf
                msg["id"], msg["parent_id"] = self._insert(db, conv_id, parent, msg), parent
                db.execute(f"UPDATE conversations SET updated_at = {db.mark} WHERE id = {db.mark}", (now, conv_id))
                # The first message names the conversation, and a new version of it renames it,
                # unless the user chose the title.
                first = "title_set = 0" if parent is not None or not retitle else "renamed = 0"
                db.execute(f"UPDATE conversations SET title = {db.mark}, title_set = 1"
                           f" WHERE id = {db.mark} AND {first}", (_title_from(content), conv_id))
        return msg

    @_guarded
    def start_assistant(self, conv_id: str, parent_id: str | None = None) -> str:
        """Add an empty 'streaming' assistant message under ``parent_id`` (default: the active
        leaf), make it active and return its id."""
        with self._conn() as db, db.transaction():
            parent = parent_id or tree.active_leaf(db, conv_id)
            return self._insert(db, conv_id, parent, {"role": "assistant", "status": "streaming", "owner": self._owner})

    @property
    def _owner(self) -> str:
        """Who writes a streaming answer: this Store in this process on this host."""
        return liveness.owner_of(self._token)

    @_guarded
    def save_partial(self, message_id: str, content: str, reasoning: str | None = None) -> None:
        """Checkpoint the text (and a thinking model's thinking) streamed so far, so a crash loses little of it."""
        with self._conn() as db:
            db.execute(f"UPDATE messages SET content = {db.mark}, reasoning = {db.mark}"
                       f" WHERE id = {db.mark} AND status = 'streaming'", (content, reasoning, message_id))

    @_guarded
    def finish_assistant(self, message_id: str, content: str, reason: str,
                         usage: dict | None = None, timings: dict | None = None, reasoning: str | None = None) -> None:
        """Store the final text (and a thinking model's thinking); 'complete' for stop/length, otherwise 'partial'."""
        now = time.time()
        with self._conn() as db, db.transaction():
            db.execute(
                f"UPDATE messages SET content = {db.mark}, status = {db.mark}, reason = {db.mark}, usage = {db.mark},"
                f" timings = {db.mark}, reasoning = {db.mark}, owner = NULL WHERE id = {db.mark}",
                (content, "complete" if reason in FINISHED else "partial", reason,
                 json.dumps(usage) if usage is not None else None,
                 json.dumps(timings) if timings is not None else None, reasoning or None, message_id))
            db.reindex(message_id)
            db.execute(
                f"UPDATE conversations SET updated_at = {db.mark}, size = size + {db.mark}"
                f" WHERE id = (SELECT conversation_id FROM messages WHERE id = {db.mark})",
                (now, len(content) + len(reasoning or ""), message_id))

    @_guarded
    def forget_client(self, client_id: str) -> int:
        """Delete every conversation (and preset) of ``client_id``; return how many conversations."""
        with self._conn() as db:
            db.execute(f"DELETE FROM presets WHERE client_id = {db.mark}", (client_id,))
            return db.execute(f"DELETE FROM conversations WHERE client_id = {db.mark}", (client_id,)).rowcount

    def expire_clients(self, prefix: str, idle_s: float) -> int:
        """Delete conversations of clients named ``prefix...`` idle for ``idle_s``; return how many."""
        with self._conn() as db:
            return db.execute(f"DELETE FROM conversations WHERE substr(client_id, 1, {db.mark}) = {db.mark}"
                              f" AND updated_at < {db.mark}", (len(prefix), prefix, time.time() - idle_s)).rowcount

    def history(self, conv_id: str, upto: str | None = None, limit: int | None = None) -> list[dict]:
        """The prompt messages: the system prompt (if any), then the non-empty turns of the active
        path (or of the path ending at ``upto``; none for ``""``), attachments as fenced blocks; at
        most the newest ``limit`` turns when given."""
        with self._conn() as db:
            conv = db.execute(f"SELECT system FROM conversations WHERE id = {db.mark}", (conv_id,)).fetchone()
            rows = tree.path(db, conv_id, upto, limit)
        out = [{"role": "system", "content": conv["system"]}] if conv is not None and conv["system"] else []
        for row in rows:
            if row["role"] == "assistant" and row["content"] == "":
                continue
            attached = json.loads(row["attachments"]) if row["attachments"] else None
            out.append({"role": row["role"], "content": files.with_attachments(row["content"], attached)})
            if row["role"] == "assistant" and row["reasoning"]:  # the template decides whether the model sees it
                out[-1]["reasoning_content"] = row["reasoning"]
        return out

    def search(self, client_id: str | None, text: str, deadline: float | None = None) -> list[dict]:
        """This client's messages that match ``text``, best first (see search.py); SearchTimeout
        when it runs past ``deadline`` (time.monotonic(); default SEARCH_BUDGET_S from now)."""
        if deadline is None:
            deadline = time.monotonic() + SEARCH_BUDGET_S
        return self._backend.search(client_id or "", text, deadline)

    @_guarded
    def import_conversation(self, client_id: str, body: Any, max_content_chars: int, address: str | None = None,
                            mark: str = transfer.IMPORTED) -> str:
        """Create a conversation of ``client_id`` from an export (every version of its tree) or a
        ``messages`` list; its id. The copy's title says it was imported (``mark``); ``address`` is
        charged for it."""
        data = transfer.parse_import(body, max_content_chars, self.max_messages)
        size = len(data["system"] or "") + sum(_size(m) for m in data["messages"])
        first = next((m["content"] for m in data["messages"] if m["role"] == "user"), "")
        title = data["title"] or (_title_from(first) if first else PLACEHOLDER_TITLE)
        conv_id, now = new_id(), time.time()
        created = data["created_at"] or now
        with self._conn() as db, db.transaction():
            self._check_room(db, client_id, address, size)
            db.execute(
                "INSERT INTO conversations (id, client_id, title, title_set, renamed, system, params, model,"
                f" created_at, updated_at, address, size) VALUES ({marks(db, 3)}, 1, {marks(db, 8)})",
                (conv_id, client_id, transfer.imported_title(title, mark), int(data["title"] is not None),
                 data["system"], json.dumps(data["params"]) if data["params"] else None, data["model"],
                 created, now, address, len(data["system"] or "")))
            ids: list = []
            for msg in data["messages"]:
                parent = ids[msg["parent"]] if msg["parent"] is not None else None
                ids.append(self._insert(db, conv_id, parent, {**msg, "created_at": msg["created_at"] or now}))
            if ids:
                db.execute(f"UPDATE conversations SET active_id = {db.mark} WHERE id = {db.mark}",
                           (ids[data["active"]], conv_id))
        return conv_id

    def branch(self, client_id: str | None, conv_id: str, message_id: str, max_content_chars: int,
               address: str | None = None) -> str | None:
        """A new conversation of ``client_id`` holding the path from the first message down to
        ``message_id`` (any message of the conversation, on any version), with the conversation's
        settings, titled "… (branch)"; its id, or None when either is not this client's."""
        conv = self.get_conversation(client_id, conv_id) if client_id else None
        if conv is None or not _valid(message_id):
            return None
        with self._conn() as db:
            if db.execute(f"SELECT 1 FROM messages WHERE id = {db.mark} AND conversation_id = {db.mark}",
                          (message_id, conv_id)).fetchone() is None:
                return None
            path = [_message(r) for r in tree.path(db, conv_id, message_id)]
        body = {"title": conv["title"], "system": conv["system"], "params": conv["params"], "model": conv["model"],
                "messages": [{k: m[k] for k in ("role", "content", "attachments", "status", "reason", "usage",
                                                "timings", "created_at", "reasoning") if k in m} for m in path]}
        return self.import_conversation(cast(str, client_id), body, max_content_chars, address, mark=" (branch)")

    def export(self, client_id: str | None, conv_id: str, fmt: str) -> tuple[str, str, str] | None:
        """(body, mimetype, filename) of the conversation as Markdown (the active path) or JSON (the
        conversation as get_conversation has it, plus its whole ``tree`` and ``active_id``), or None."""
        if fmt not in ("md", "json"):
            raise ValueError(f"unknown export format {fmt!r}")
        conv = self.get_conversation(client_id, conv_id)
        if conv is None:
            return None
        filename = transfer.filename(conv, fmt)
        if fmt == "json":
            with self._conn() as db:
                conv["tree"] = [_message(r) for r in tree.every(db, conv_id)]
            for msg in conv["tree"]:
                del msg["conversation_id"]
            conv["active_id"] = conv["messages"][-1]["id"] if conv["messages"] else None
            return json.dumps(conv, ensure_ascii=False, indent=2) + "\n", "application/json", filename
        return transfer.markdown(conv), "text/markdown", filename

