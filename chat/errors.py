"""The error hierarchy: converted to protocol frames or JSON only at the edge."""
from __future__ import annotations


class ChatError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(ChatError):
    """A CHAT_* setting is invalid; start-up stops with this message."""


class ProtocolError(ChatError):
    """A request cannot be served; carries its protocol ``code`` and optional request ``id``."""

    http_status = {
        "bad_json": 400, "bad_message": 400, "unknown_type": 400, "too_large": 413,
        "unknown_id": 404, "duplicate_id": 409, "busy": 409, "overloaded": 503,
        "rate_limited": 429, "not_found": 404, "internal": 500, "unauthorized": 401,
        "forbidden": 403,
    }

    def __init__(self, code: str, message: str, id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id

    def frame(self) -> dict:
        """The WebSocket ``error`` frame."""
        out = {"type": "error", "code": self.code, "message": self.message}
        if self.id is not None:
            out["id"] = self.id
        return out

    @property
    def status(self) -> int:
        return self.http_status.get(self.code, 400)


class StorageFull(ProtocolError):
    """The database cannot grow (disk full, or CHAT_DB_MAX_MB): nothing new is stored, nothing stored is lost."""

    def __init__(self, id: str | None = None):
        super().__init__("overloaded", "the server's storage is full: nothing was saved; try again later", id)


class BackendError(ChatError):
    """The engine or the remote backend failed while generating."""
