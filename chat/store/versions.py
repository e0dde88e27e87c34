"""Versions: the Store's operations on a conversation's message tree (edit, regenerate, continue, switch)."""
from __future__ import annotations

from ..errors import ProtocolError
from . import tree
from .backend import Host
from .disk_full import guarded

# Answers that ``continue`` may extend: cut short, not ended by the model.
CONTINUABLE = ("length", "cancelled", "timeout", "shutdown")


class Versions:
    """Mixed into Store (``Host``): looks up the targets of edit/regenerate/continue and switches versions."""

    def user_message(self: Host, client_id: str | None, conv_id: str, message_id: object) -> dict | None:
        """For edit: the user message ``message_id`` on the active path (bad_message when it is
        not one); None if the conversation is not this client's."""
        with self._conn() as db:
            if not tree.owned(db, client_id, conv_id):
                return None
            return tree.message(tree.on_path(db, conv_id, message_id, "user"))

    def question_for(self: Host, client_id: str | None, conv_id: str, message_id: object = None) -> dict | None:
        """For regenerate: the user message that ``message_id`` (an assistant message on the
        active path; default the last message) answers. None if not this client's; bad_message
        when there is nothing to answer."""
        with self._conn() as db:
            if not tree.owned(db, client_id, conv_id):
                return None
            rows = tree.path(db, conv_id)
            if message_id is not None:
                answer = tree.on_path(db, conv_id, message_id, "assistant")
                rows = rows[:[r["id"] for r in rows].index(answer["id"])]
            elif rows and rows[-1]["role"] == "assistant":
                rows = rows[:-1]
        if not rows or rows[-1]["role"] != "user":
            raise ProtocolError("bad_message", "the conversation has no user message to answer")
        return tree.message(rows[-1])

    def continuable(self: Host, client_id: str | None, conv_id: str) -> dict | None:
        """For continue: the last message of the active path when it is an answer cut short
        (length, cancelled, timeout, shutdown, interrupted). None if not this client's."""
        with self._conn() as db:
            if not tree.owned(db, client_id, conv_id):
                return None
            rows = tree.path(db, conv_id, limit=1)
        last = tree.message(rows[-1]) if rows else None
        if last is None or last["role"] != "assistant":
            raise ProtocolError("bad_message", "the conversation does not end with an answer to continue")
        # A streaming answer is left to the caller's busy check: it may well end cut short.
        if last["status"] not in ("interrupted", "streaming") and last["reason"] not in CONTINUABLE:
            raise ProtocolError("bad_message", f"the last answer ended with {last['reason']!r}; only an answer "
                                               "cut short can be continued")
        return last

    @guarded
    def reopen_assistant(self: Host, message_id: str) -> None:
        """Mark a finished answer 'streaming' again, to be extended in place by ``continue``."""
        with self._conn() as db:
            db.execute(f"UPDATE messages SET status = 'streaming', owner = {db.mark} WHERE id = {db.mark}",
                             (self._owner, message_id))

    @guarded
    def edit_answer(self: Host, client_id: str | None, conv_id: str, message_id: object, content: str) -> dict | None:
        """A new version of the answer ``message_id`` (on the active path) with the user's own ``content``,
        reason "edited", made active (what followed the old version stays on its branch); the
        conversation, or None if not this client's. bad_message for a message that is not such an answer."""
        with self._conn() as db:
            if not tree.owned(db, client_id, conv_id):
                return None
            answer = tree.message(tree.on_path(db, conv_id, message_id, "assistant"))
        if answer["status"] == "streaming":
            raise ProtocolError("busy", "this answer is still being written")
        edited = self.start_assistant(conv_id, answer["parent_id"])
        self.finish_assistant(edited, content, "edited")
        return self.get_conversation(client_id, conv_id)

    @guarded
    def set_active(self: Host, client_id: str | None, conv_id: str, message_id: object) -> dict | None:
        """Make the path through ``message_id`` (down to its newest descendant) active and return
        the conversation; None if not this client's, bad_message if not its message."""
        with self._conn() as db:
            if not tree.owned(db, client_id, conv_id):
                return None
            with db.transaction():
                leaf = tree.newest_descendant(db, conv_id, message_id) if tree.valid(message_id) else None
                if leaf is None:
                    raise ProtocolError("bad_message", "message_id is not a message of this conversation")
                db.execute(f"UPDATE conversations SET active_id = {db.mark} WHERE id = {db.mark}", (leaf, conv_id))
        return self.get_conversation(client_id, conv_id)
