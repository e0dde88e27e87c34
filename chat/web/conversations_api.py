"""HTTP API over the caller's own conversations: list, read, change (title, pin, archive, settings),
delete (to the trash) and restore, versions, export, import, search."""
from __future__ import annotations

from typing import TypeVar

from flask import Blueprint, Response, jsonify, request

from ..app_state import app_state
from ..errors import ProtocolError
from ..limits import cost_of
from ..store import Store
from ..store.trash import VIEWS
from . import conversation_patch, guard, json_input
from .conversation_bulk import change, empty_trash
from .identity import current_client

bp = Blueprint("conversations", __name__, url_prefix="/api")

EXPORT_FORMATS = ("md", "json")
MAX_IMPORT_BYTES = 2 * 2**20  # the same cap as nginx's client_max_body_size
MAX_QUERY_CHARS = 500
MAX_ID_CHARS = 64  # a message id (32 hex digits here)
MAX_IMPORT_CONVERSATIONS = 100  # in one import of several (an export of a selection)

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
    """This client's conversations, newest first, each saying whether it is answering now; ``view``:
    main (default), archived or trash."""
    view = request.args.get("view", "main")
    if view not in VIEWS:
        raise ProtocolError("bad_message", f"view must be one of {', '.join(VIEWS)}")
    client = current_client()
    empty_trash()
    conversations = _store().list_conversations(client, view)
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
    """Move a conversation to the trash (CHAT_TRASH_DAYS), or with ``?forever=1`` (or no trash) delete
    it and its messages for good, from the trash too."""
    forever = request.args.get("forever") in ("1", "true") or not app_state().settings.trash_days
    change(current_client(), "delete" if forever else "trash", [conv_id], one=True)
    return jsonify(id=conv_id, deleted=True, trash=not forever)


@bp.post("/conversations/<conv_id>/restore")
def restore(conv_id: str) -> Response:
    """Bring a conversation back from the trash, where it was in the list; the conversation without messages."""
    client = current_client()
    change(client, "restore", [conv_id], one=True)
    return jsonify(_found(_store().update(client, conv_id, {})))


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


@bp.put("/conversations/<conv_id>/messages/<message_id>")
def edit_answer(conv_id: str, message_id: str) -> Response:
    """Edit an answer: ``{"content"}`` becomes a new version of that answer (on the active path), reason
    "edited"; the conversation as GET returns it."""
    body = request.get_json(silent=True)
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str) or not content.strip():
        raise ProtocolError("bad_message", "body must be a JSON object with a non-empty string 'content'")
    state = app_state()
    limit = 4 * state.settings.max_content_chars
    if len(content) > limit:
        raise ProtocolError("too_large", f"an answer may be at most {limit} characters")
    client = current_client()
    if state.store and state.store.owns(client, conv_id) and state.turns.runs.busy(conv_id):
        raise ProtocolError("busy", "this conversation is answering; edit once the answer ends")
    return jsonify(_with_answering(client, _found(_store().edit_answer(client, conv_id, message_id, content))))


@bp.post("/conversations/<conv_id>/branch")
def branch(conv_id: str) -> tuple[Response, int]:
    """Branch into a new chat: ``{"message_id"}``, any message of it; the path down to that message becomes
    a new conversation of this client ("… (branch)", the same settings): 201 {"id"}."""
    body = request.get_json(silent=True)
    message_id = body.get("message_id") if isinstance(body, dict) else None
    if not isinstance(message_id, str):
        raise ProtocolError("bad_message", "body must be a JSON object with a string 'message_id'")
    state = app_state()
    new = _store().branch(current_client(), conv_id, message_id, state.settings.max_content_chars,
                          guard.address(state.settings))
    return jsonify(id=_found(new)), 201


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
    store, chars = _store(), state.settings.max_content_chars
    if isinstance(body, dict) and isinstance(body.get("conversations"), list):  # several (Export of a selection)
        bundle = body["conversations"]
        if not bundle or len(bundle) > MAX_IMPORT_CONVERSATIONS:
            raise ProtocolError("bad_message", f"'conversations' must hold 1-{MAX_IMPORT_CONVERSATIONS} conversations")
        ids = [store.import_conversation(client, one, chars, address) for one in bundle]
        return jsonify(id=ids[0], ids=ids), 201
    return jsonify(id=store.import_conversation(client, body, chars, address)), 201


@bp.get("/search")
def search() -> Response:
    """Full-text search over this client's own messages."""
    q = request.args.get("q", "")
    if len(q) > MAX_QUERY_CHARS:
        raise ProtocolError("bad_message", f"q may be at most {MAX_QUERY_CHARS} characters")
    state = app_state()
    return jsonify(results=state.searches.run(_store(), current_client(), guard.address(state.settings), q))
