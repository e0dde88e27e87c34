"""A conversation's own settings: title, pin, system prompt, sampling parameters and model."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .backend import Host, Row
from .disk_full import guarded
from .transfer import clean_title
from .tree import owned

# What ``update`` may change, and how each is stored. None clears system, params and model.
_COLUMNS: dict[str, Callable[[Any], object]] = {
    "title": lambda v: clean_title(v) or "…",
    "pinned": lambda v: int(bool(v)),
    "system": lambda v: v or None,
    "params": lambda v: json.dumps(v) if v else None,
    "model": lambda v: v or None,
    "archived": lambda v: int(bool(v)),
}
CONVERSATION_COLUMNS = "id, title, system, created_at, updated_at, pinned, params, model, archived, deleted_at"


def conversation(row: Row) -> dict:
    """A conversation row as the API shows it: ``pinned`` and ``archived`` bools, ``params`` an object,
    ``deleted_at`` when it went to the trash (else None)."""
    out = dict(row)
    out["pinned"] = bool(out["pinned"])
    out["archived"] = bool(out["archived"])
    out["params"] = json.loads(out["params"]) if out["params"] else {}
    return out


class Options:
    """Mixed into Store (``Host``): changes a conversation's settings, and reads those its turns use."""

    @guarded
    def update(self: Host, client_id: str | None, conv_id: str, changes: dict) -> dict | None:
        """Apply ``changes`` (validated by the caller; keys of _COLUMNS) and return the conversation
        without its messages; None if it is not this client's. A new title counts as the user's
        own (an edited first message no longer renames it). The conversation keeps its place in
        the list: nothing here touches ``updated_at``."""
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown conversation fields {sorted(unknown)}")
        with self._conn() as db:
            if not owned(db, client_id, conv_id):
                return None
            sets = [f"{name} = {db.mark}" for name in changes]
            values = [_COLUMNS[name](value) for name, value in changes.items()]
            if "title" in changes:
                sets += ["title_set = 1", "renamed = 1"]
            if sets:
                db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = {db.mark}", (*values, conv_id))
            row = db.execute(f"SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE id = {db.mark}",
                             (conv_id,)).fetchone()
        return conversation(row)

    @guarded
    def set_title(self: Host, conv_id: str, title: str) -> bool:
        """The model's title for a conversation its user has not named; from then on it is the one title,
        whatever version of the first message is shown. False when the user named it first (or it is gone)."""
        with self._conn() as db:
            return db.execute(f"UPDATE conversations SET title = {db.mark}, title_set = 1, renamed = 1"
                              f" WHERE id = {db.mark} AND renamed = 0", (title, conv_id)).rowcount > 0

    def options(self: Host, conv_id: str) -> dict:
        """{params, model} the conversation's turns use ({} and None for one not stored yet)."""
        with self._conn() as db:
            row = db.execute(f"SELECT params, model FROM conversations WHERE id = {db.mark}", (conv_id,)).fetchone()
        if row is None:
            return {"params": {}, "model": None}
        return {"params": json.loads(row["params"]) if row["params"] else {}, "model": row["model"]}
