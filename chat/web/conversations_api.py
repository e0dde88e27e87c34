"""HTTP API over the caller's own conversations: list, read, change (title, pin, settings), delete,
versions, export, import, search."""
from __future__ import annotations

from typing import TypeVar

from flask import Blueprint, Response, jsonify, request

from ..app_state import app_state
from ..errors import ProtocolError
from ..limits import cost_of
from ..store import Store
from . import conversation_patch, guard, json_input
from .identity import current_client

bp = Blueprint("conversations", __name__, url_prefix="/api")

EXPORT_FORMATS = ("md", "json")
MAX_IMPORT_BYTES = 2 * 2**20  # the same cap as nginx's client_max_body_size
MAX_QUERY_CHARS = 500
MAX_ID_CHARS = 64  # a message id (32 hex digits here)

T = TypeVar("T")


def _store() -> Store:
    """The app's conversation store (the blueprint is registered only where there is one)."""
    store = app_state().store
    assert store is not None
    return store


def _found(value: T | None) -> T:
    """``value`` unless it is None/False, which means "not this client's" (never which)."""
    if value is None or value is False:
        raise ProtocolError("not_found", "conversation not found")
    return value


guard.private_api(bp)


@bp.get("/conversations")
def index() -> Response:
    """This client's conversations, newest first, each saying whether it is answering now."""
    client = current_client()
    conversations = _store().list_conversations(client)
    busy = app_state().turns.runs.answering_in(client, [c["id"] for c in conversations])
    for c in conversations:
        c["answering"] = c["id"] in busy
    return jsonify(conversations)


@bp.get("/conversations/<conv_id>")
def show(conv_id: str) -> Response:
    """One conversation with its messages, and the answer running in it (``answering``: a request
    of this client another socket or tab may ``resume`` to follow it live), or null."""
    client = current_client()
    return jsonify(_with_answering(client, _found(_store().get_conversation(client, conv_id))))


def _with_answering(client: str | None, conversation: dict) -> dict:
    """The conversation as GET shows it: with the request answering in it now, or null."""
    conversation["answering"] = app_state().turns.runs.answering(client, conversation["id"])
    return conversation


@bp.patch("/conversations/<conv_id>")
def update(conv_id: str) -> Response:
    """Rename, pin, or change the settings its turns use; the conversation without its messages."""
    state = app_state()
    changes = conversation_patch.parse(request.get_json(silent=True), state.settings, state.engine)
    return jsonify(_found(_store().update(current_client(), conv_id, changes)))


@bp.delete("/conversations/<conv_id>")
def delete(conv_id: str) -> Response:
    """Delete a conversation and its messages."""
    _found(_store().delete(current_client(), conv_id))
    app_state().engine.forget(conv_id)  # its KV too, in memory and on disk
    return jsonify(id=conv_id, deleted=True)


@bp.get("/conversations/<conv_id>/export")
def export(conv_id: str) -> Response:
    """Download a conversation as Markdown or JSON."""
    fmt = request.args.get("format", "md")
    if fmt not in EXPORT_FORMATS:
        raise ProtocolError("bad_message", f"format must be one of {', '.join(EXPORT_FORMATS)}")
    body, mimetype, filename = _found(_store().export(current_client(), conv_id, fmt))
    return Response(body, mimetype=mimetype,
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})


@bp.post("/conversations/<conv_id>/active")
def activate(conv_id: str) -> Response:
    """Switch versions: make the path through a message active; the conversation as GET returns it."""
    body = request.get_json(silent=True)
    message_id = body.get("message_id") if isinstance(body, dict) else None
    if not isinstance(message_id, str) or len(message_id) > MAX_ID_CHARS:
        raise ProtocolError("bad_message", f"body must be a JSON object with a 'message_id' of at most "
                                           f"{MAX_ID_CHARS} characters")
    client = current_client()
    return jsonify(_with_answering(client, _found(_store().set_active(client, conv_id, message_id))))


@bp.post("/conversations/import")
def import_() -> tuple[Response, int]:
    """Create a conversation of this client from an export or an OpenAI-style messages list."""
    client = current_client()
    if not client:
        raise ProtocolError("bad_message", "no client identity: open the page first to get one")
    if (request.content_length or 0) > MAX_IMPORT_BYTES:
        raise ProtocolError("too_large", f"an import may be at most {MAX_IMPORT_BYTES // 2**20} MiB")
    raw = request.get_data(cache=False)
    if len(raw) > MAX_IMPORT_BYTES:  # a chunked body declares no length
        raise ProtocolError("too_large", f"an import may be at most {MAX_IMPORT_BYTES // 2**20} MiB")
    try:
        body = json_input.loads(raw)
    except json_input.NotText as exc:
        raise ProtocolError("bad_message", str(exc)) from None
    except (ValueError, RecursionError):
        raise ProtocolError("bad_message", "the body is not valid JSON") from None
    state = app_state()
    address = guard.address(state.settings)
    state.limits.spend(address, client, cost_of(len(raw)))  # a big import costs as much as many chats
    conv_id = _store().import_conversation(client, body, state.settings.max_content_chars, address)
    return jsonify(id=conv_id), 201


@bp.get("/search")
def search() -> Response:
    """Full-text search over this client's own messages."""
    q = request.args.get("q", "")
    if len(q) > MAX_QUERY_CHARS:
        raise ProtocolError("bad_message", f"q may be at most {MAX_QUERY_CHARS} characters")
    state = app_state()
    return jsonify(results=state.searches.run(_store(), current_client(), guard.address(state.settings), q))
