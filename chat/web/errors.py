"""Errors become responses here, once: JSON for the API routes (404 and 500 included), pages untouched."""
from __future__ import annotations

import logging

from flask import jsonify, request
from werkzeug.exceptions import HTTPException, InternalServerError

from ..errors import ChatError
from . import openai_api

log = logging.getLogger(__name__)

API_PREFIXES = ("/api/", "/v1/", "/ws")
_CODES = {400: "bad_message", 401: "unauthorized", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 413: "too_large", 429: "rate_limited", 503: "overloaded"}


def _is_api() -> bool:
    return request.path.startswith(API_PREFIXES) or request.path in ("/api", "/v1")


def response(exc: ChatError):
    """The JSON response for ``exc``: OpenAI's shape on /v1, ``{"error": {code, message}}`` elsewhere."""
    if request.path.startswith("/v1"):
        out = jsonify(openai_api.error_body(exc))
        if exc.status == 401:
            out.headers["WWW-Authenticate"] = "Bearer"
    else:
        out = jsonify({"error": {"code": exc.code, "message": exc.message}})
    out.status_code = exc.status
    return out


def init_app(app) -> None:
    """Install the app-wide handlers."""

    @app.errorhandler(ChatError)
    def _chat_error(exc: ChatError):
        return response(exc)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        if not _is_api():
            return exc
        message = (exc.description or exc.name).strip() if exc.code != 413 else "the request body is too large"
        return response(ChatError(message, _CODES.get(exc.code, "internal"), exc.code))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        if not _is_api():
            return InternalServerError()
        return response(ChatError("internal server error"))
