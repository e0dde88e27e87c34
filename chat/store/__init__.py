"""Conversations in one SQLite file or a PostgreSQL database; this package is the only code
that touches sqlite3 or psycopg."""
from .conversations import PLACEHOLDER_TITLE, Store, new_id
from .schema import MIGRATIONS

__all__ = ["MIGRATIONS", "PLACEHOLDER_TITLE", "Store", "new_id", "open_store"]


def open_store(settings, alive=None) -> Store:
    """The Store CHAT_DB names (an SQLite file, or a postgresql:// URL), with the settings' quotas.
    ``alive(owner)``: who may still be writing a streaming answer (see Store.recover)."""
    return Store(settings.db_path, settings.max_conversations, settings.max_messages, settings.db_max_mb,
                 alive=alive)
