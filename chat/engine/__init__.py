"""The engine layer: the interface the web sees, the local batching engine, the remote one.

Only this package imports torch and transformers, and only in the modules that
run the model (``local``, ``model``); importing the package itself stays light.
"""
from __future__ import annotations

from .base import Engine, GenParams, Generation
from .events import Delta, Done, Queued, Refused, Started

__all__ = ["Engine", "GenParams", "Generation", "Queued", "Started", "Delta", "Done", "Refused",
           "make_engine"]


def make_engine(settings) -> Engine:
    """The engine named by the settings: the local model, or a remote OpenAI-compatible one."""
    if settings.backend == "openai":
        from .remote import RemoteEngine
        return RemoteEngine(settings)
    from .local import LocalEngine
    return LocalEngine(settings)
