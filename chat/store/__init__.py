"""Conversations in one SQLite file or a PostgreSQL database; this package is the only code
that touches sqlite3 or psycopg."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .conversations import PLACEHOLDER_TITLE, Store, new_id
from .postgres import is_url
from .schema import MIGRATIONS

if TYPE_CHECKING:
    from ..config import Settings

AUTO = -1  # CHAT_DB_MAX_MB=auto
AUTO_SHARE = 0.8

__all__ = ["MIGRATIONS", "PLACEHOLDER_TITLE", "Store", "new_id", "open_store"]


def open_store(settings: Settings, alive: Callable[[str | None], bool] | None = None) -> Store:
    """The Store CHAT_DB names (an SQLite file, or a postgresql:// URL), with the settings' quotas.
    ``alive(owner)``: who may still be writing a streaming answer (see Store.recover)."""
    return Store(settings.db_path, settings.max_conversations, settings.max_messages,
                 db_cap_mb(settings.db_path, settings.db_max_mb), alive=alive,
                 max_mb_per_address=settings.max_storage_mb_per_ip)


def db_cap_mb(path: str, setting: int) -> int:
    """CHAT_DB_MAX_MB as SQLite's cap in MiB (0: none). ``auto`` (-1): what the file holds now plus
    AUTO_SHARE of the space free on its disk, so the database never fills the disk on its own
    (the model cache, logs and the system keep the rest); PostgreSQL and ``:memory:`` get none."""
    if setting != AUTO or path == ":memory:" or is_url(path):
        return max(setting, 0)
    folder = Path(path).parent
    while not folder.exists():
        folder = folder.parent
    held = sum(f.stat().st_size for f in Path(path).parent.glob(Path(path).name + "*") if f.is_file()) \
        if Path(path).parent.exists() else 0
    return max(1, int((held + shutil.disk_usage(folder).free * AUTO_SHARE) // 2**20))
