"""A self-hosted, real-time chat server for small instruct LLMs."""
from __future__ import annotations

import logging

from flask import Flask

from .config import Settings
from .metrics import Metrics
from .web import identity

__version__ = "0.1.0"
ANONYMOUS_STALE_S = 24 * 3600


class AppState:
    """What the blueprints share, all declared here: settings, engine, store, the turn service, limits."""

    def __init__(self, settings: Settings, engine, store, shared=None):
        from .turns import TurnService
        from .limits import Limits
        self.settings = settings
        self.engine = engine
        self.store = store
        self.shared = shared  # state.SharedState with CHAT_STATE_URL, else None: all in this process
        self.metrics = Metrics(engine)
        self.limits = shared.limits if shared else Limits(settings)
        self.turns = TurnService(settings, engine, store, self.metrics, self.limits,
                                 shared.runs if shared else None)
        self.sessions: set = set()  # open WebSocket sessions, closed at shutdown


def create_app(settings: Settings | None = None, engine=None, store=None) -> Flask:
    """Build the Flask app; the engine starts loading its model on its own thread."""
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__, static_folder="../static", template_folder="../templates")
    app.config["SOCK_SERVER_OPTIONS"] = {
        "ping_interval": settings.ping_interval_s or None,
        "max_message_size": settings.max_message_bytes,
        "subprotocols": [identity.SUBPROTOCOL],  # echoed when offered; a bearer.<key> offer never is
    }
    shared = None
    if settings.state_url and not settings.engine_only:  # an engine process keeps no runs of its own
        from .state import SharedState
        shared = SharedState(settings)
    if settings.engine_only:
        store = None  # /v1 stores nothing: an engine process opens no database
    elif store is None:
        from .store import open_store
        store = open_store(settings, alive=shared.alive if shared else None)
    if store is not None:
        # Conversations of cookie-less connections are unreachable once the socket is gone; each
        # is deleted when its connection ends, and a crash's leftovers here, once surely stale.
        store.expire_clients(identity.ANONYMOUS, ANONYMOUS_STALE_S)
    if engine is None:
        from .engine import make_engine
        engine = make_engine(settings)
    app.extensions["chat"] = AppState(settings, engine, store, shared)
    if shared is not None:
        shared.start(store)

    from . import web
    web.init_app(app, engine_only=settings.engine_only)
    return app
