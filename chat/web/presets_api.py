"""/api/presets: the caller's named sets of a system prompt and sampling parameters (list, make,
change, delete); the page applies one to a chat, or to new chats."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, request
from flask.typing import ResponseReturnValue

from .. import params as sampling
from ..app_state import app_state
from ..errors import ProtocolError
from ..store.transfer import clean_title
from . import guard
from .identity import current_client

bp = Blueprint("presets", __name__, url_prefix="/api/presets")

MAX_NAME_CHARS = 80


def _store():
    """The app's conversation store (this blueprint exists only where there is one)."""
    return app_state().store


guard.private_api(bp)


def _parsed(body: Any) -> tuple[str, str | None, dict]:
    """{name, system, params}, checked: a name of 1-80 characters, a system prompt within the
    message limit, parameters as the chat frame's."""
    settings = app_state().settings
    if not isinstance(body, dict):
        raise ProtocolError("bad_message", "the body must be a JSON object")
    name = body.get("name")
    if not isinstance(name, str) or len(name) > 4 * MAX_NAME_CHARS or not 0 < len(clean_title(name)) <= MAX_NAME_CHARS:
        raise ProtocolError("bad_message", f"'name' must be 1-{MAX_NAME_CHARS} characters")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise ProtocolError("bad_message", "'system' must be a string or null")
    if system and len(system) > settings.max_content_chars:
        raise ProtocolError("too_large", f"'system' is longer than {settings.max_content_chars} characters")
    params = body.get("params") or {}
    problem = sampling.problem(params, settings.max_new_tokens)
    if problem:
        raise ProtocolError("bad_message", problem)
    return clean_title(name), system or None, sampling.clean(params)


@bp.get("")
def index() -> ResponseReturnValue:
    """The caller's presets, oldest first."""
    return jsonify(_store().presets(current_client()))


@bp.post("")
def make() -> ResponseReturnValue:
    """A new preset (201)."""
    return jsonify(_store().save_preset(current_client(), *_parsed(request.get_json(silent=True)))), 201


@bp.put("/<preset_id>")
def change(preset_id: str) -> ResponseReturnValue:
    """Replace a preset's name, system prompt and parameters."""
    preset = _store().save_preset(current_client(), *_parsed(request.get_json(silent=True)), preset_id=preset_id)
    if preset is None:
        raise ProtocolError("not_found", "no such preset")
    return jsonify(preset)


@bp.delete("/<preset_id>")
def delete(preset_id: str) -> ResponseReturnValue:
    """Delete a preset (the chats that used it keep their settings)."""
    if not _store().delete_preset(current_client(), preset_id):
        raise ProtocolError("not_found", "no such preset")
    return jsonify(id=preset_id, deleted=True)
