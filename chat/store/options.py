"""A conversation's own settings: title, pin, system prompt, sampling parameters and model."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from .disk_full import guarded

# What ``update`` may change, and how each is stored. None clears system, params and model.
_COLUMNS = {
    "title": lambda v: v,
    "pinned": lambda v: int(bool(v)),
    "system": lambda v: v or None,
    "params": lambda v: json.dumps(v) if v else None,
    "model": lambda v: v or None,
}
CONVERSATION_COLUMNS = "id, title, system, created_at, updated_at, pinned, params, model"


def conversation(row) -> dict:
    """A conversation row as the API shows it: ``pinned`` a bool, ``params`` an object."""
    out = dict(row)
    out["pinned"] = bool(out["pinned"])
    out["params"] = json.loads(out["params"]) if out["params"] else {}
    return out


class Options:
    """Mixed into Store: changes a conversation's settings, and reads those its turns use."""

    if TYPE_CHECKING:  # what Store, which this is mixed into, provides
        _conn: Callable[[], Any]
        _owned: Callable[[Any, str | None, Any], bool]

    @guarded
    def update(self, client_id: str | None, conv_id, changes: dict) -> dict | None:
        """Apply ``changes`` (validated by the caller; keys of _COLUMNS) and return the conversation
        without its messages; None if it is not this client's. A new title counts as the user's
        own (an edited first message no longer renames it). The conversation keeps its place in
        the list: nothing here touches ``updated_at``."""
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown conversation fields {sorted(unknown)}")
        with self._conn() as db:
            if not self._owned(db, client_id, conv_id):
                return None
            sets = [f"{name} = ?" for name in changes]
            values = [_COLUMNS[name](value) for name, value in changes.items()]
            if "title" in changes:
                sets += ["title_set = 1", "renamed = 1"]
            if sets:
                db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*values, conv_id))
            row = db.execute(f"SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return conversation(row)

    def options(self, conv_id: str) -> dict:
        """{params, model} the conversation's turns use ({} and None for one not stored yet)."""
        with self._conn() as db:
            row = db.execute("SELECT params, model FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        if row is None:
            return {"params": {}, "model": None}
        return {"params": json.loads(row["params"]) if row["params"] else {}, "model": row["model"]}
