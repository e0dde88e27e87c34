"""App-wide error handling: JSON errors with a request id, details only in the log."""
from __future__ import annotations

import logging
import uuid

from flask import jsonify, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class SafeJSONProvider(DefaultJSONProvider):
    """Flask's JSON, with too-deep nesting reported as invalid JSON instead of a RecursionError."""

    def loads(self, s, **kwargs):
        try:
            return super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None


def request_id() -> str:
    """A short id that ties a client-facing error to its log line."""
    return uuid.uuid4().hex[:12]


def _unexpected(exc: Exception):
    """Anything unplanned: a generic message and a request id for the client, the traceback for the log."""
    if isinstance(exc, HTTPException):
        return exc  # werkzeug's own 4xx/5xx answers
    rid = request_id()
    log.error("request %s %s %s failed", rid, request.method, request.path, exc_info=exc)
    return jsonify(error={"code": "internal", "message": f"internal server error (request id {rid})",
                          "request_id": rid}), 500


def init_app(app) -> None:
    """Install the JSON provider and the last-resort error handler."""
    app.json = SafeJSONProvider(app)
    app.register_error_handler(Exception, _unexpected)
