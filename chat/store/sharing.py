"""Read-only links to one conversation: a secret token per shared conversation (CHAT_SHARING)."""
from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, Callable

from .disk_full import guarded
from .tree import owned

TOKEN_BYTES = 24  # 32 URL-safe characters: not guessable


class Sharing:
    """Mixed into Store: make, read and revoke a conversation's share token."""

    if TYPE_CHECKING:  # what Store, which this is mixed into, provides
        _conn: Callable[[], Any]
        get_conversation: Callable[[str | None, Any], dict | None]

    def share_token(self, client_id: str | None, conv_id: str) -> str | None | bool:
        """The conversation's token (None: not shared); False if it is not this client's."""
        with self._conn() as db:
            if not owned(db, client_id, conv_id):
                return False
            row = db.execute(f"SELECT share_token FROM conversations WHERE id = {db.mark}", (conv_id,)).fetchone()
        return row["share_token"]

    @guarded
    def share(self, client_id: str | None, conv_id: str) -> str | None:
        """Share the conversation: its token (the one it has, else a new one); None if not this client's."""
        with self._conn() as db, db.transaction():
            if not owned(db, client_id, conv_id):
                return None
            row = db.execute(f"SELECT share_token FROM conversations WHERE id = {db.mark}", (conv_id,)).fetchone()
            if row["share_token"]:
                return row["share_token"]
            token = secrets.token_urlsafe(TOKEN_BYTES)
            db.execute(f"UPDATE conversations SET share_token = {db.mark} WHERE id = {db.mark}", (token, conv_id))
        return token

    @guarded
    def unshare(self, client_id: str | None, conv_id: str) -> bool:
        """Revoke the conversation's link (the token is gone for good); False if not this client's."""
        with self._conn() as db:
            if not owned(db, client_id, conv_id):
                return False
            db.execute(f"UPDATE conversations SET share_token = NULL WHERE id = {db.mark}", (conv_id,))
        return True

    def shared(self, token: str) -> dict | None:
        """What a link shows: the title, the model (None: the server's default), when it last changed, and
        the active path's messages (role, content, status, reason, time, attachments' names), nothing
        about the owner or other conversations; None for an unknown token."""
        if not isinstance(token, str) or not 20 <= len(token) <= 64:
            return None
        with self._conn() as db:
            row = db.execute(f"SELECT id, client_id FROM conversations WHERE share_token = {db.mark}",
                             (token,)).fetchone()
        if row is None:
            return None
        conv = self.get_conversation(row["client_id"], row["id"])
        if conv is None:
            return None
        return {"title": conv["title"], "model": conv["model"], "updated_at": conv["updated_at"], "messages": [
            {"role": m["role"], "content": m["content"], "status": m["status"], "reason": m["reason"],
             "created_at": m["created_at"],
             "attachments": [{"name": a.get("name", "")} for a in m.get("attachments") or []]}
            for m in conv["messages"]]}
