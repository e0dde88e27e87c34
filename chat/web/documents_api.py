"""/api/documents: an attached PDF, DOCX, HTML or CSV file read to text on the server (in a worker
process, chat/documents.py), with its pages and tokens; /api/tokens: how many tokens a text is."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from .. import documents
from ..app_state import app_state
from ..concurrency import run_in_thread
from ..errors import ProtocolError, RequestError
from ..limits import cost_of
from . import guard
from .identity import current_client

bp = Blueprint("documents", __name__, url_prefix="/api")

MAX_NAME_CHARS = 200
MAX_COUNTED_CHARS = 4_000_000  # what /api/tokens counts at most


@bp.before_request
def _checks() -> None:
    """Writes from the page's own origin only; a document comes as application/octet-stream, a type
    another site's page cannot post without this server agreeing first (CORS)."""
    settings = app_state().settings
    guard.check_origin(settings, "request")
    wanted = "application/octet-stream" if request.endpoint == "documents.read" else "application/json"
    if request.mimetype != wanted:
        raise RequestError("bad_message", f"the body must be sent as Content-Type: {wanted}", 400)


@bp.after_request
def _private(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"
    return response


def _tokens(text: str) -> int | None:
    engine = app_state().engine
    return run_in_thread(engine.count_tokens, text) if text else 0


@bp.post("/documents")
def read() -> Response:
    """?name=<file name>, the file as the body: {"name", "text", "pages", "chars", "tokens", "truncated"}."""
    state = app_state()
    name = request.args.get("name", "").strip()
    if not name or len(name) > MAX_NAME_CHARS:
        raise ProtocolError("bad_message", f"?name must be the file's name, 1-{MAX_NAME_CHARS} characters")
    limit = state.settings.max_document_mb * 2**20
    if (request.content_length or 0) > limit:
        raise ProtocolError("too_large", f"a document may be at most {state.settings.max_document_mb} MB")
    data = request.get_data(cache=False)
    if len(data) > limit:
        raise ProtocolError("too_large", f"a document may be at most {state.settings.max_document_mb} MB")
    if not data:
        raise ProtocolError("bad_message", f"“{name}” is empty")
    state.limits.spend(guard.address(state.settings), current_client(), cost_of(len(data)))
    result = documents.extract(name, data, state.settings.max_content_chars)
    text = result["text"]
    if not text.strip():
        raise ProtocolError("bad_message", f"“{name}” has no text to read (a scan? this server does not read images)")
    return jsonify(name=name, text=text, pages=result["pages"], chars=len(text), tokens=_tokens(text),
                   truncated=result["truncated"])


@bp.post("/tokens")
def tokens() -> Response:
    """{"text": ...}: {"tokens": how many tokens it is for the default model, or null when unknown}."""
    body = request.get_json(silent=True)
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise ProtocolError("bad_message", "body must be a JSON object with a string 'text'")
    if len(text) > MAX_COUNTED_CHARS:
        raise ProtocolError("too_large", f"at most {MAX_COUNTED_CHARS} characters are counted")
    return jsonify(tokens=_tokens(text))
