"""The transports: the page, the WebSocket, the conversations API, the OpenAI-compatible API."""
from __future__ import annotations

from flask import Flask


def init_app(app: Flask, engine_only: bool = False) -> None:
    """Register the blueprints, the WebSocket route and the error handlers.

    ``engine_only``: only ``/v1`` and health, for web workers that use this process as their backend.
    """
    from . import (conversation_bulk, conversations_api, documents_api, error_responses, health, hosts, openai_api,
                   openai_completions, pages, presets_api, request_body, sharing, ws)
    hosts.init_app(app, app.extensions["chat"].settings)
    app.register_blueprint(health.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(openai_completions.bp)
    if engine_only:  # the page's app-wide hooks (hardening headers, proxy warning), without the page
        app.before_request(pages.warn_about_untrusted_proxy)
        app.after_request(pages.security_headers)
    else:
        app.register_blueprint(pages.bp)
        app.register_blueprint(conversations_api.bp)
        app.register_blueprint(conversation_bulk.bp)
        app.register_blueprint(documents_api.bp)
        app.register_blueprint(sharing.bp)
        app.register_blueprint(presets_api.bp)
        ws.init_app(app)
    error_responses.init_app(app)
    settings = app.extensions["chat"].settings
    app.wsgi_app = request_body.BoundedBody(  # type: ignore[method-assign]
        app.wsgi_app, settings.body_timeout_s, settings.max_content_chars, settings.max_document_mb * 2**20)
