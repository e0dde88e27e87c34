"""Versions: a conversation's message tree, its active path and the siblings at each level."""
from __future__ import annotations

import re

MESSAGE_COLUMNS = ("m.id, m.conversation_id, m.parent_id, m.role, m.content, m.attachments, m.status,"
                   " m.reason, m.usage, m.timings, m.created_at")
_DEEPEST = 2 ** 62
_ID = re.compile(r"[0-9a-f]{32}")


def valid(*ids) -> bool:
    """Whether every value has the shape of an id the store hands out."""
    return all(isinstance(i, str) and _ID.fullmatch(i) for i in ids)


def path(db, conv_id: str, leaf: str | None = None, limit: int | None = None) -> list:
    """Message rows from the root down to ``leaf`` (default: the active leaf), oldest first;
    only the newest ``limit`` of them when given."""
    args: tuple[str, ...]
    if leaf is None:
        start, args = "SELECT active_id, 0 FROM conversations WHERE id = ?", (conv_id,)
    else:
        start, args = "SELECT id, 0 FROM messages WHERE id = ? AND conversation_id = ?", (leaf, conv_id)
    return db.execute(
        f"""WITH RECURSIVE up(id, depth) AS ({start}
            UNION ALL SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
            WHERE m.parent_id IS NOT NULL AND up.depth + 1 < ?)
        SELECT {MESSAGE_COLUMNS} FROM up JOIN messages m ON m.id = up.id ORDER BY up.depth DESC""",
        args + (limit or _DEEPEST,)).fetchall()


def every(db, conv_id: str) -> list:
    """Every message row of the conversation, each after its parent (in the order they were made)."""
    return db.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.conversation_id = ? ORDER BY m.seq",
                      (conv_id,)).fetchall()


def versions(db, conv_id: str, messages: list[dict]) -> None:
    """Give each message of a path its ``versions``: {index, count, ids} of its siblings."""
    siblings: dict = {}
    for row in db.execute("SELECT id, parent_id FROM messages WHERE conversation_id = ? ORDER BY seq",
                          (conv_id,)):
        siblings.setdefault(row["parent_id"], []).append(row["id"])
    for msg in messages:
        ids = siblings.get(msg["parent_id"], [msg["id"]])
        msg["versions"] = {"index": ids.index(msg["id"]), "count": len(ids), "ids": ids}


def newest_descendant(db, conv_id: str, message_id: str) -> str | None:
    """The most recent message in the subtree of ``message_id`` (itself when it has none)."""
    row = db.execute(
        """WITH RECURSIVE down(id, seq) AS (
            SELECT id, seq FROM messages WHERE id = ? AND conversation_id = ?
            UNION ALL SELECT m.id, m.seq FROM messages m JOIN down ON m.parent_id = down.id)
        SELECT id FROM down ORDER BY seq DESC LIMIT 1""", (message_id, conv_id)).fetchone()
    return row["id"] if row is not None else None


def active_leaf(db, conv_id: str) -> str | None:
    """The last message of the active path, or None for an empty conversation; on PostgreSQL
    the conversation row stays locked until the caller's transaction ends."""
    row = db.execute("SELECT active_id FROM conversations WHERE id = ?" + db.lock_rows, (conv_id,)).fetchone()
    return row["active_id"] if row is not None else None
