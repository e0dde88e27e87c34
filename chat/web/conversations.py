"""HTTP API over the caller's own conversations: list, read, rename, delete, export."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify, request

from ..errors import ProtocolError
from .identity import current_client

bp = Blueprint("conversations", __name__, url_prefix="/api/conversations")

MAX_TITLE_CHARS = 200
EXPORT_FORMATS = ("md", "json")


def _store():
    """The app's conversation store."""
    return current_app.extensions["chat"].store


def _found(value):
    """``value`` unless it is None/False, which means "not this client's" (never which)."""
    if value is None or value is False:
        raise ProtocolError("not_found", "conversation not found")
    return value


def _title() -> str:
    """The new title from the JSON body: a non-empty string of at most MAX_TITLE_CHARS."""
    body = request.get_json(silent=True)
    title = body.get("title") if isinstance(body, dict) else None
    if not isinstance(title, str) or not title.strip():
        raise ProtocolError("bad_message", "body must be a JSON object with a non-empty string 'title'")
    if len(title.strip()) > MAX_TITLE_CHARS:
        raise ProtocolError("bad_message", f"'title' is longer than {MAX_TITLE_CHARS} characters")
    return title.strip()


@bp.after_request
def _private(response):
    """Keep conversations out of shared caches."""
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.get("")
def index():
    """This client's conversations, newest first."""
    return jsonify(_store().list_conversations(current_client()))


@bp.get("/<conv_id>")
def show(conv_id):
    """One conversation with its messages."""
    return jsonify(_found(_store().get_conversation(current_client(), conv_id)))


@bp.patch("/<conv_id>")
def rename(conv_id):
    """Rename a conversation."""
    title = _title()
    _found(_store().rename(current_client(), conv_id, title))
    return jsonify(id=conv_id, title=title)


@bp.delete("/<conv_id>")
def delete(conv_id):
    """Delete a conversation and its messages."""
    _found(_store().delete(current_client(), conv_id))
    return jsonify(id=conv_id, deleted=True)


@bp.get("/<conv_id>/export")
def export(conv_id):
    """Download a conversation as Markdown or JSON."""
    fmt = request.args.get("format", "md")
    if fmt not in EXPORT_FORMATS:
        raise ProtocolError("bad_message", f"format must be one of {', '.join(EXPORT_FORMATS)}")
    body, mimetype, filename = _found(_store().export(current_client(), conv_id, fmt))
    return Response(body, mimetype=mimetype,
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})
