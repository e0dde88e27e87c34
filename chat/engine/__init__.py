"""The engine layer: the interface the web sees, the local batching engine, the remote one.

Only this package imports torch and transformers (``local`` and the modules it
loads: the model, its weights, kernels and KV); importing the package itself stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Engine, Generation, GenParams
from .events import Delta, Done, Queued, Refused, Started

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["Engine", "GenParams", "Generation", "Queued", "Started", "Delta", "Done", "Refused",
           "make_engine"]


def make_engine(settings: Settings) -> Engine:
    """The engine named by the settings: the local model, or a remote OpenAI-compatible one."""
    if settings.backend == "openai":
        from .remote.client import RemoteEngine
        return RemoteEngine(settings)
    from .kernels.cpu import limit
    limit(settings.cpu_isa)  # before torch is imported: its kernels read the CPU class once
    from .core.local import LocalEngine
    return LocalEngine(settings)
