"""Several conversations at once: to the trash, back, archived, deleted for good (``POST
/api/conversations/bulk``), exported as one file (``POST /api/conversations/export``); and the trash
emptied of what is past CHAT_TRASH_DAYS."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from flask import Blueprint, Response, jsonify, request

from ..app_state import app_state
from ..errors import ProtocolError
from ..store import Store
from ..store.trash import MAX_BULK
from . import guard
from .identity import current_client

bp = Blueprint("conversation_bulk", __name__, url_prefix="/api")
guard.private_api(bp)

ACTIONS = ("trash", "restore", "archive", "unarchive", "delete")
EMPTY_EVERY_S = 600.0  # how often (at most) a listing empties the trash of what is past its days
_emptied = [0.0]
_emptying = threading.Lock()


def _store() -> Store:
    store = app_state().store
    assert store is not None  # registered only where there is one
    return store


def change(client: str | None, action: str, ids: list[str], one: bool = False) -> list[str]:
    """Apply ``action`` to this client's conversations among ``ids``; the ids changed. With ``one``, an
    id that is not this client's (or not where the action needs it: ``restore`` out of the trash) is
    ``not_found``."""
    store = _store()
    done = {"trash": store.trash, "restore": store.restore, "delete": store.purge,
            "archive": lambda c, i: store.archive(c, i, True),
            "unarchive": lambda c, i: store.archive(c, i, False)}[action](client, ids)
    if action in ("trash", "delete"):
        for conv_id in done:
            app_state().engine.forget(conv_id)  # its KV too, in memory and on disk
    if one and not done:
        raise ProtocolError("not_found", "conversation not found")
    return done


def empty_trash() -> None:
    """Delete for good what has been in the trash past CHAT_TRASH_DAYS (every client's; now and then)."""
    days = app_state().settings.trash_days
    now = time.monotonic()
    if not days or now - _emptied[0] < EMPTY_EVERY_S or not _emptying.acquire(blocking=False):
        return
    try:
        _emptied[0] = now
        for conv_id in _store().empty_trash(days * 86400):
            app_state().engine.forget(conv_id)
    finally:
        _emptying.release()


def _ids(body: Any) -> list[str]:
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ProtocolError("bad_message", "body must be a JSON object with a non-empty 'ids' list of strings")
    if len(ids) > MAX_BULK:
        raise ProtocolError("too_large", f"at most {MAX_BULK} conversations at once")
    return ids


@bp.post("/conversations/bulk")
def bulk() -> Response:
    """{"action": one of ACTIONS, "ids": [...]}: the action taken ("delete" for "trash" without a trash)
    and the ids it changed (others are not this client's, or were already so)."""
    body = request.get_json(silent=True)
    action = body.get("action") if isinstance(body, dict) else None
    if action not in ACTIONS:
        raise ProtocolError("bad_message", f"'action' must be one of {', '.join(ACTIONS)}")
    ids, client = _ids(body), current_client()
    if action == "trash" and not app_state().settings.trash_days:  # no trash: deleted at once
        action = "delete"
    return jsonify(action=action, ids=change(client, action, ids))


@bp.post("/conversations/export")
def export_several() -> Response:
    """{"ids": [...], "format": "json" | "md"}: those of this client's conversations as one download,
    in the order given: JSON ``{"conversations": [each as its own export]}`` (Import takes it whole),
    or the Markdown exports one after another."""
    body = request.get_json(silent=True)
    fmt = body.get("format", "json") if isinstance(body, dict) else None
    if fmt not in ("json", "md"):
        raise ProtocolError("bad_message", "format must be one of md, json")
    client, store = current_client(), _store()
    parts = [part for conv_id in dict.fromkeys(_ids(body)) if (part := store.export(client, conv_id, fmt))]
    if not parts:
        raise ProtocolError("not_found", "conversation not found")
    stamp = time.strftime("%Y-%m-%d")
    if fmt == "json":
        text = json.dumps({"conversations": [json.loads(p[0]) for p in parts]}, ensure_ascii=False, indent=2) + "\n"
        mimetype = "application/json"
    else:
        text, mimetype = "\n\n---\n\n".join(p[0].rstrip("\n") for p in parts) + "\n", "text/markdown"
    name = f"conversations-{len(parts)}-{stamp}.{fmt}"
    return Response(text, mimetype=mimetype, headers={"Content-Disposition": f'attachment; filename="{name}"'})
