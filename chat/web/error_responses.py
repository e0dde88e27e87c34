"""Errors become responses here, once: JSON for the API routes (404 and 500 included), pages untouched.

Nothing internal reaches a client: an unplanned error answers with a request id, and the
log line under that id has the traceback.
"""
from __future__ import annotations

import logging
import uuid

from typing import Any

from flask import Flask, Response, jsonify, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import HTTPException, InternalServerError

from ..errors import ChatError
from . import json_input, openai_api

log = logging.getLogger(__name__)

API_PREFIXES = ("/api/", "/v1/", "/ws")
_CODES = {400: "bad_message", 401: "unauthorized", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 413: "too_large", 429: "rate_limited", 503: "overloaded"}


class SafeJSONProvider(DefaultJSONProvider):
    """Flask's JSON, with too-deep nesting reported as invalid JSON instead of a RecursionError."""

    def loads(self, s: str | bytes, **kwargs) -> Any:
        try:
            value = super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if json_input.has_lone_surrogate(value):  # NotText is a ValueError: a 400 like bad JSON
            raise json_input.NotText()
        return value


def request_id() -> str:
    """A short id that ties a client-facing error to its log line."""
    return uuid.uuid4().hex[:12]


def _is_api() -> bool:
    return request.path.startswith(API_PREFIXES) or request.path in ("/api", "/v1")


def response(exc: ChatError, extra: dict | None = None) -> Response:
    """The JSON response for ``exc``: OpenAI's shape on /v1, ``{"error": {code, message}}`` elsewhere."""
    v1 = request.path.startswith("/v1")
    body = openai_api.error_body(exc) if v1 else {"error": {"code": exc.code, "message": exc.message}}
    body["error"].update(extra or {})
    out = jsonify(body)
    if v1 and exc.status == 401:
        out.headers["WWW-Authenticate"] = "Bearer"
    out.status_code = exc.status
    retry_after = getattr(exc, "retry_after", None)
    if retry_after:
        out.headers["Retry-After"] = str(retry_after)
    return out


def init_app(app: Flask) -> None:
    """Install the JSON provider and the app-wide handlers."""
    app.json = SafeJSONProvider(app)

    @app.errorhandler(ChatError)
    def _chat_error(exc: ChatError):
        return response(exc)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        if not _is_api():
            return exc
        message = (exc.description or exc.name).strip() if exc.code != 413 else "the request body is too large"
        return response(ChatError(message, _CODES.get(exc.code or 0, "internal"), exc.code))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        rid = request_id()
        log.error("request %s %s %s failed", rid, request.method, request.path, exc_info=exc)
        if not _is_api():
            return InternalServerError()
        return response(ChatError(f"internal server error (request id {rid})"), {"request_id": rid})
