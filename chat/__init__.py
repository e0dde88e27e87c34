"""A self-hosted, real-time chat server for small instruct LLMs."""
from __future__ import annotations

import logging

from typing import TYPE_CHECKING

from flask import Flask

from .app_state import AppState, app_state
from .config import Settings
from .web import identity

if TYPE_CHECKING:
    from .engine import Engine
    from .store import Store

__all__ = ["AppState", "app_state", "create_app"]
__version__ = "0.1.0"
ANONYMOUS_STALE_S = 24 * 3600


def create_app(settings: Settings | None = None, engine: Engine | None = None,
               store: Store | None = None) -> Flask:
    """Build the Flask app; the engine starts loading its model on its own thread."""
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__, static_folder="../static", template_folder="../templates")
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": settings.ping_interval_s or None,
        "max_message_size": settings.max_message_bytes,
        "subprotocols": [identity.SUBPROTOCOL],  # echoed when offered; a bearer.<key> offer never is
        # chat/web/ws_server.py: unread input and every write bounded
        "max_unread": 2 * settings.max_message_bytes,
        "send_timeout": settings.send_timeout_s,
    }
    from .state import open_state
    state_backend = open_state(settings)  # the one place that picks this process or Redis
    if settings.engine_only:
        store = None  # /v1 stores nothing: an engine process opens no database
    elif store is None:
        from .store import open_store
        store = open_store(settings, alive=state_backend.alive)
    if store is not None:
        # Conversations of cookie-less connections are unreachable once the socket is gone; each
        # is deleted when its connection ends, and a crash's leftovers here, once surely stale.
        store.expire_clients(identity.ANONYMOUS, ANONYMOUS_STALE_S)
    if engine is None:
        from .engine import make_engine
        engine = make_engine(settings)
    app.extensions["chat"] = AppState(settings, engine, store, state_backend)
    state_backend.start(store)

    from . import web
    web.init_app(app, engine_only=settings.engine_only)
    return app
