"""What the blueprints share (``AppState``), the one accessor for it, and the app's shutdown in order."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Protocol

from flask import Flask, current_app

from .config import Settings
from .metrics import Metrics

if TYPE_CHECKING:
    from .engine import Engine
    from .state import StateBackend
    from .store import Store

SETTLE_S = 5.0  # what ending the last answers may take after the engine stops (TurnService.shutdown)
CLOSE_SOCKET_S = 1.0  # a reader that stalls at shutdown gets this long, not CHAT_SEND_TIMEOUT_S


class Socket(Protocol):
    """An open WebSocket session, as shutdown sees it."""

    def close(self, code: int, reason: str, timeout: float | None = None) -> None:
        """Close the connection (within ``timeout`` seconds)."""

    def draining(self) -> None:
        """Tell the client the server is stopping (the ``draining`` frame), before the close."""


class AppState:
    """What the blueprints share, all declared here: settings, engine, store, the turn service, limits."""

    def __init__(self, settings: Settings, engine: Engine, store: Store | None, state_backend: StateBackend) -> None:
        from .turns import TurnService
        from .searches import Searches
        self.settings = settings
        self.engine = engine
        self.store = store
        self.state_backend = state_backend  # runs and limits: this process's, or every worker's in Redis
        self.metrics = Metrics(engine)
        self.limits = state_backend.limits
        self.turns = TurnService(settings, engine, store, self.metrics, self.limits, state_backend.runs)
        self.sessions: set[Socket] = set()  # open WebSocket sessions, closed at shutdown
        self.searches = Searches(settings.search_timeout_s)  # /api/search, off the event loop
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped_by = 0.0  # when a shutdown under way will have ended, at the latest

    def shutdown(self, timeout: float) -> None:
        """Stop serving, in this order: take no new turns; let running answers finish within
        ``timeout``; end the rest with ``shutdown`` (each stores its partial text); close the
        sockets (1001). ``close`` follows, once the server has let go of every connection
        (under gunicorn: its ``worker_exit``). A second call does nothing."""
        if self._stopping.is_set():
            return
        self._stopped_by = time.monotonic() + max(0.0, timeout) + SETTLE_S + CLOSE_SOCKET_S
        self._stopping.set()
        try:
            # Each client learns at once why its next turn would be refused and its socket will close.
            for session in list(self.sessions):
                session.draining()
            self.turns.shutdown(timeout)
            for session in list(self.sessions):
                session.close(1001, "server shutting down", timeout=CLOSE_SOCKET_S)
        finally:
            self._stopped.set()

    @property
    def stopping(self) -> bool:
        """True once a shutdown has begun (the server drains: no new turns)."""
        return self._stopping.is_set()

    def close(self) -> None:
        """The last step: stop the engine, close the store and the state backend. A shutdown still
        under way (its answers storing their partial text) is given until its deadline first.

        Not part of ``shutdown``: a kept-alive HTTP connection may still bring a request until the
        server closes it, and that request needs the store."""
        if self._stopping.is_set():
            self._stopped.wait(max(0.0, self._stopped_by - time.monotonic()))
        self.engine.shutdown("shutdown")
        if self.store is not None:
            self.store.close()
        self.state_backend.close()


def app_state(app: Flask | None = None) -> AppState:
    """The AppState of ``app``, by default of the app serving this request."""
    return (app or current_app).extensions["chat"]
