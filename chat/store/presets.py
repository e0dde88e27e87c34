"""A client's presets: named sets of a system prompt and sampling parameters, chosen per chat."""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ProtocolError
from .backend import marks
from .disk_full import guarded

MAX_PRESETS = 50  # per client
_COLUMNS = "id, name, system, params, created_at, updated_at"


def _preset(row: Any) -> dict:
    out = dict(row)
    out["params"] = json.loads(out["params"]) if out["params"] else {}
    return out


class Presets:
    """Mixed into Store: a client's presets, by name (unique per client), oldest first."""

    if TYPE_CHECKING:  # what Store, which this is mixed into, provides
        _conn: Callable[[], Any]

    def presets(self, client_id: str) -> list[dict]:
        """This client's presets, in the order they were made."""
        with self._conn() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM presets WHERE client_id = {db.mark}"
                              " ORDER BY created_at, id",
                              (client_id,)).fetchall()
        return [_preset(r) for r in rows]

    @guarded
    def save_preset(self, client_id: str, name: str, system: str | None, params: dict,
                    preset_id: str | None = None) -> dict | None:
        """Make a preset (``preset_id`` None) or change one of this client's (None if it has no such
        one). A name another of its presets has, or a 51st preset, is refused."""
        now = time.time()
        with self._conn() as db, db.transaction():
            clash = db.execute(f"SELECT id FROM presets WHERE client_id = {db.mark} AND name = {db.mark}",
                               (client_id, name)).fetchone()
            if clash is not None and clash["id"] != preset_id:
                raise ProtocolError("bad_message", f"you already have a preset named {name!r}")
            values = (name, system or None, json.dumps(params) if params else None, now)
            if preset_id is None:
                count = db.execute(f"SELECT count(*) AS n FROM presets WHERE client_id = {db.mark}",
                                   (client_id,)).fetchone()
                if count["n"] >= MAX_PRESETS:
                    raise ProtocolError("too_large", f"at most {MAX_PRESETS} presets; delete one first")
                preset_id = uuid.uuid4().hex
                db.execute("INSERT INTO presets (name, system, params, updated_at, id, client_id, created_at)"
                           f" VALUES ({marks(db, 7)})", (*values, preset_id, client_id, now))
            elif not db.execute(f"UPDATE presets SET name = {db.mark}, system = {db.mark}, params = {db.mark},"
                                f" updated_at = {db.mark} WHERE id = {db.mark} AND client_id = {db.mark}",
                                (*values, preset_id, client_id)).rowcount:
                return None
            row = db.execute(f"SELECT {_COLUMNS} FROM presets WHERE id = {db.mark}", (preset_id,)).fetchone()
        return _preset(row)

    @guarded
    def delete_preset(self, client_id: str, preset_id: str) -> bool:
        """Delete one of this client's presets; False if it has no such one."""
        with self._conn() as db:
            return db.execute(f"DELETE FROM presets WHERE id = {db.mark} AND client_id = {db.mark}",
                              (preset_id, client_id)).rowcount > 0
