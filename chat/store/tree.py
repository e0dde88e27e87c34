"""Versions: a conversation's message tree, its active path and the siblings at each level; the
ownership check every read of a conversation starts with."""
from __future__ import annotations

import json
import re
from typing import TypeGuard

from ..errors import ProtocolError
from .backend import Connection, Row

MESSAGE_COLUMNS = ("m.id, m.conversation_id, m.parent_id, m.role, m.content, m.attachments, m.status,"
                   " m.reason, m.usage, m.timings, m.created_at, m.reasoning")
_DEEPEST = 2 ** 62
_ID = re.compile(r"[0-9a-f]{32}")


def valid(value: object) -> TypeGuard[str]:
    """Whether ``value`` has the shape of an id the store hands out."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def owned(db: Connection, client_id: str | None, conv_id: object) -> bool:
    """Whether the conversation exists, belongs to ``client_id`` (never another's, whatever the ids) and
    is not in the trash."""
    return (valid(conv_id) and isinstance(client_id, str) and client_id != "" and
            db.execute(f"SELECT 1 FROM conversations WHERE id = {db.mark} AND client_id = {db.mark}"
                       " AND deleted_at IS NULL", (conv_id, client_id)).fetchone() is not None)


def message(row: Row) -> dict:
    """A message row as a dict, with its JSON columns decoded."""
    out = dict(row)
    for key in ("usage", "timings"):
        out[key] = json.loads(out[key]) if out[key] else None
    out["attachments"] = json.loads(out["attachments"]) if out.get("attachments") else []
    if not out.get("reasoning"):  # a thinking model's thinking, only where there is some
        out.pop("reasoning", None)
    return out


def path(db: Connection, conv_id: str, leaf: str | None = None, limit: int | None = None) -> list[Row]:
    """Message rows from the root down to ``leaf`` (default: the active leaf), oldest first;
    only the newest ``limit`` of them when given."""
    args: tuple[str, ...]
    if leaf is None:
        start, args = f"SELECT active_id, 0 FROM conversations WHERE id = {db.mark}", (conv_id,)
    else:
        start = f"SELECT id, 0 FROM messages WHERE id = {db.mark} AND conversation_id = {db.mark}"
        args = (leaf, conv_id)
    return db.execute(
        f"""WITH RECURSIVE up(id, depth) AS ({start}
            UNION ALL SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
            WHERE m.parent_id IS NOT NULL AND up.depth + 1 < {db.mark})
        SELECT {MESSAGE_COLUMNS} FROM up JOIN messages m ON m.id = up.id ORDER BY up.depth DESC""",
        (*args, limit or _DEEPEST)).fetchall()


def on_path(db: Connection, conv_id: str, message_id: object, role: str) -> Row:
    """The message of ``role`` on the active path, or bad_message (never another conversation's)."""
    if valid(message_id):
        for row in path(db, conv_id):
            if row["id"] == message_id and row["role"] == role:
                return row
    raise ProtocolError("bad_message",
                        f"message_id is not one of the {role} messages on this conversation's active path")


def every(db: Connection, conv_id: str) -> list[Row]:
    """Every message row of the conversation, each after its parent (in the order they were made)."""
    return db.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.conversation_id = {db.mark}"
                      " ORDER BY m.seq", (conv_id,)).fetchall()


def versions(db: Connection, conv_id: str, messages: list[dict]) -> None:
    """Give each message of a path its ``versions``: {index, count, ids} of its siblings."""
    siblings: dict = {}
    for row in db.execute(f"SELECT id, parent_id FROM messages WHERE conversation_id = {db.mark} ORDER BY seq",
                          (conv_id,)):
        siblings.setdefault(row["parent_id"], []).append(row["id"])
    for msg in messages:
        ids = siblings.get(msg["parent_id"], [msg["id"]])
        msg["versions"] = {"index": ids.index(msg["id"]), "count": len(ids), "ids": ids}


def newest_descendant(db: Connection, conv_id: str, message_id: str) -> str | None:
    """The most recent message in the subtree of ``message_id`` (itself when it has none)."""
    row = db.execute(
        f"""WITH RECURSIVE down(id, seq) AS (
            SELECT id, seq FROM messages WHERE id = {db.mark} AND conversation_id = {db.mark}
            UNION ALL SELECT m.id, m.seq FROM messages m JOIN down ON m.parent_id = down.id)
        SELECT id FROM down ORDER BY seq DESC LIMIT 1""", (message_id, conv_id)).fetchone()
    return row["id"] if row is not None else None


def active_leaf(db: Connection, conv_id: str) -> str | None:
    """The last message of the active path, or None for an empty conversation; where the backend
    locks rows (PostgreSQL), the conversation row stays locked until the caller's transaction ends."""
    row = db.execute(f"SELECT active_id FROM conversations WHERE id = {db.mark}" + db.lock_rows,
                     (conv_id,)).fetchone()
    return row["active_id"] if row is not None else None
