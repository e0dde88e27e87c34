"""Archive and trash: a conversation archived (out of the main list, whole), moved to the trash and
restored from it, and the trash emptied once its days are over (a Store mixin)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .disk_full import guarded
from .tree import valid

VIEWS = ("main", "archived", "trash")  # which conversations a listing shows
MAX_BULK = 500  # conversations one bulk change may name


class Trash:
    """Mixed into Store: move conversations to the trash and back, archive them, empty the trash."""

    if TYPE_CHECKING:  # what Store, which this is mixed into, provides
        _conn: Callable[[], Any]

    @guarded
    def trash(self, client_id: str | None, conv_ids: list[str]) -> list[str]:
        """Move this client's conversations among ``conv_ids`` to the trash; the ids moved. In the
        trash a conversation is not found by anything but its listing, restore and delete."""
        return self._set(client_id, conv_ids, "deleted_at = {mark}", (time.time(),), "deleted_at IS NULL")

    @guarded
    def restore(self, client_id: str | None, conv_ids: list[str]) -> list[str]:
        """Bring conversations back from the trash, where they were; the ids restored."""
        return self._set(client_id, conv_ids, "deleted_at = NULL", (), "deleted_at IS NOT NULL")

    @guarded
    def archive(self, client_id: str | None, conv_ids: list[str], archived: bool = True) -> list[str]:
        """Archive (or unarchive) conversations not in the trash; the ids changed."""
        return self._set(client_id, conv_ids, "archived = {mark}", (int(archived),),
                         f"deleted_at IS NULL AND archived = {int(not archived)}")

    @guarded
    def purge(self, client_id: str | None, conv_ids: list[str]) -> list[str]:
        """Delete conversations for good (their messages too), in the trash or not; the ids deleted."""
        ids = self._mine(client_id, conv_ids, "1 = 1")
        if ids:
            with self._conn() as db:
                db.execute(f"DELETE FROM conversations WHERE id IN ({', '.join([db.mark] * len(ids))})", tuple(ids))
        return ids

    @guarded
    def empty_trash(self, older_than_s: float) -> list[str]:
        """Delete for good every conversation in the trash for longer than ``older_than_s``; their ids."""
        cutoff = time.time() - older_than_s
        with self._conn() as db, db.transaction():
            rows = db.execute(f"SELECT id FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < {db.mark}",
                              (cutoff,)).fetchall()
            db.execute(f"DELETE FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < {db.mark}", (cutoff,))
        return [r["id"] for r in rows]

    def _mine(self, client_id: str | None, conv_ids: list[str], where: str) -> list[str]:
        """Those of ``conv_ids`` that are this client's and match ``where``, in the order given."""
        wanted = [c for c in dict.fromkeys(conv_ids) if valid(c)]
        if not client_id or not wanted:
            return []
        with self._conn() as db:
            rows = db.execute(f"SELECT id FROM conversations WHERE client_id = {db.mark} AND {where}"
                              f" AND id IN ({', '.join([db.mark] * len(wanted))})", (client_id, *wanted)).fetchall()
        found = {r["id"] for r in rows}
        return [c for c in wanted if c in found]

    def _set(self, client_id: str | None, conv_ids: list[str], change: str, values: tuple, where: str) -> list[str]:
        """Apply ``change`` to this client's conversations among ``conv_ids`` that match ``where``."""
        wanted = [c for c in dict.fromkeys(conv_ids) if valid(c)]
        if not client_id or not wanted:
            return []
        with self._conn() as db, db.transaction():
            marks = ", ".join([db.mark] * len(wanted))
            scope = f"client_id = {db.mark} AND {where} AND id IN ({marks})"
            rows = db.execute(f"SELECT id FROM conversations WHERE {scope}", (client_id, *wanted)).fetchall()
            db.execute(f"UPDATE conversations SET {change.format(mark=db.mark)} WHERE {scope}",
                       (*values, client_id, *wanted))
        found = {r["id"] for r in rows}
        return [c for c in wanted if c in found]
