"""What ``PATCH /api/conversations/<id>`` may change, and how each field is checked: a table."""
from __future__ import annotations

from typing import Any

from .. import params as sampling
from ..config import Settings
from ..engine import Engine
from ..errors import ProtocolError
from ..store.transfer import clean_title

MAX_TITLE_CHARS = 200
MAX_MODEL_CHARS = 200


def _bad(message: str):
    raise ProtocolError("bad_message", message)


def _title(value: Any, settings: Settings, engine: Engine) -> str:
    if not isinstance(value, str) or not clean_title(value):
        _bad("'title' must be a non-empty string (control characters do not count)")
    if len(value) > 4 * MAX_TITLE_CHARS or len(clean_title(value)) > MAX_TITLE_CHARS:
        _bad(f"'title' is longer than {MAX_TITLE_CHARS} characters")
    return clean_title(value)


def _pinned(value: Any, settings: Settings, engine: Engine) -> bool:
    if not isinstance(value, bool):
        _bad("'pinned' must be true or false")
    return value


def _archived(value: Any, settings: Settings, engine: Engine) -> bool:
    if not isinstance(value, bool):
        _bad("'archived' must be true or false")
    return value


def _system(value: Any, settings: Settings, engine: Engine) -> str | None:
    if value is not None and not isinstance(value, str):
        _bad("'system' must be a string or null")
    if value and len(value) > settings.max_content_chars:
        raise ProtocolError("too_large", f"'system' is longer than {settings.max_content_chars} characters")
    return value or None


def _params(value: Any, settings: Settings, engine: Engine) -> dict:
    problem = sampling.problem({} if value is None else value, settings.max_new_tokens)
    if problem:
        _bad(problem)
    return sampling.clean(value)


def _model(value: Any, settings: Settings, engine: Engine) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_MODEL_CHARS:
        _bad(f"'model' must be null or a model name of 1-{MAX_MODEL_CHARS} characters")
    if engine.ready and value not in engine.models():
        _bad(f"the model {value!r} is not served here")
    return value


FIELDS = {"title": _title, "pinned": _pinned, "archived": _archived, "system": _system, "params": _params,
          "model": _model}


def parse(body: Any, settings: Settings, engine: Engine) -> dict:
    """The changes a PATCH body asks for (at least one of FIELDS; unknown fields are ignored)."""
    if not isinstance(body, dict):
        _bad("body must be a JSON object")
    changes = {name: check(body[name], settings, engine) for name, check in FIELDS.items() if name in body}
    if not changes:
        _bad(f"body must set at least one of {', '.join(FIELDS)}")
    return changes
