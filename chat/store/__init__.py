"""Conversations in one SQLite file; this package is the only code that touches sqlite3."""
from .conversations import PLACEHOLDER_TITLE, Store, new_id
from .schema import MIGRATIONS

__all__ = ["MIGRATIONS", "PLACEHOLDER_TITLE", "Store", "new_id"]
