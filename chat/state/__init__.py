"""Where runs, busy conversations and limits are kept: in this process, or shared by every worker in Redis.

The core declares what it needs (``chat.runs.RunRegistry``, ``chat.limits.Limits``);
``local_*`` modules keep it in this process, ``redis_*`` modules in Redis
(``CHAT_STATE_URL``), and ``open_state`` picks one at start-up. Only the ``redis_*``
modules import ``redis``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from ..limits import Limits
from ..runs import RunRegistry
from .local_limits import LocalLimits
from .local_runs import LocalRuns

if TYPE_CHECKING:
    from ..config import Settings
    from ..store import Store


class StateBackend(Protocol):
    """The run registry and limits of one worker, and what else the app needs from where they live."""

    @property
    def runs(self) -> RunRegistry:
        """Every run by (client, request id), and the busy conversations."""

    @property
    def limits(self) -> Limits:
        """Admission for connections and answers."""

    @property
    def alive(self) -> Callable[[str | None], bool] | None:
        """Whether the writer of a streaming answer may still be at work (see ``Store.recover``);
        None: the store's own check."""

    def start(self, store: Store | None) -> None:
        """Start background work (once the store is open)."""

    def close(self) -> None:
        """Stop it; what this worker held is released or lapses."""


class LocalState:
    """Runs and limits of this process alone: nothing to start or close."""

    alive = None

    def __init__(self, settings: Settings) -> None:
        self.runs = LocalRuns()
        self.limits = LocalLimits(settings)

    def start(self, store: Store | None) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Nothing to release."""


def open_state(settings: Settings) -> StateBackend:
    """Redis with CHAT_STATE_URL (except in an engine-only process, which keeps no runs of its own
    and leaves per-address limits to the web hosts), else this process alone."""
    if settings.state_url and not settings.engine_only:
        from .redis_state import RedisState
        return RedisState(settings)
    return LocalState(settings)
