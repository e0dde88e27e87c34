"""The transports: the page, the WebSocket, the conversations API, the OpenAI-compatible API."""
from __future__ import annotations


def init_app(app) -> None:
    """Register every blueprint, the WebSocket route and the error handlers."""
    from . import conversations, errors, health, openai_api, pages, ws
    app.register_blueprint(pages.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(conversations.bp)
    app.register_blueprint(openai_api.bp)
    ws.init_app(app)
    errors.init_app(app)
