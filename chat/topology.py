"""Startup advice when one process is not the whole picture: where the model runs, where shared state lives."""
from __future__ import annotations

from .config import Settings


def warnings(settings: Settings) -> list[str]:
    """What the operator should hear at startup about ``settings``' worker topology (empty: nothing)."""
    workers = settings.workers
    if workers <= 1:
        return []
    advice = []
    if settings.backend == "local":
        advice.append(
            f"CHAT_WORKERS={workers} with the local backend: every worker loads its own model copy "
            f"({workers} copies in memory, no batching across workers). Run one engine process per host "
            "(CHAT_ENGINE_ONLY=1, one worker) and point the web workers at it with CHAT_BACKEND=openai "
            "CHAT_BACKEND_URL=http://engine-host:8001/v1 (docs/scaling.md)")
    if not settings.engine_only and not settings.state_url:
        advice.append(
            f"CHAT_WORKERS={workers} without CHAT_STATE_URL: resume, Stop from another tab, the "
            "one-answer-per-conversation check and every rate and concurrency limit are per worker. "
            "Set CHAT_STATE_URL=redis://... to share them, or run one worker per instance behind nginx "
            "made sticky by the identity cookie (docs/scaling.md)")
    return advice
