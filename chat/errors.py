"""The error hierarchy: every error carries a ``code`` and an HTTP ``status``; the edge converts it once."""
from __future__ import annotations

# The wire protocol's error codes (docs: protocol.md) and the HTTP status each maps to.
PROTOCOL_STATUS = {
    "bad_json": 400, "bad_message": 400, "unknown_type": 400, "too_large": 413,
    "duplicate_id": 409, "unknown_id": 404, "not_found": 404, "busy": 409,
    "rate_limited": 429, "overloaded": 503, "internal": 500,
}


class ChatError(Exception):
    """Base of every error this package raises on purpose: a ``code``, a message, a ``status``."""

    code = "internal"
    status = 500

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class ConfigError(ChatError):
    """A CHAT_* setting is invalid; start-up stops with this message."""


class ProtocolError(ChatError):
    """A client request refused with one of the protocol's codes, for the request ``id``."""

    def __init__(self, code: str, message: str, id: str | None = None) -> None:
        if code not in PROTOCOL_STATUS:
            raise ValueError(f"{code!r} is not a protocol error code")
        super().__init__(message, code, PROTOCOL_STATUS[code])
        self.id = id


class RequestError(ChatError):
    """An HTTP API refusal outside the protocol's codes; ``param`` names the offending field."""

    def __init__(self, code: str, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message, code, status)
        self.param = param


class StorageFull(ProtocolError):
    """The database cannot grow (disk full, or CHAT_DB_MAX_MB): nothing new is stored, nothing stored is lost."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__("overloaded", "the server's storage is full: nothing was saved; try again later", id)


class StoreBusy(ProtocolError):
    """The database stayed locked by another writer past its busy timeout: nothing was changed."""

    retry_after = 2  # seconds, for HTTP's Retry-After

    def __init__(self, id: str | None = None) -> None:
        super().__init__("overloaded", "the database is busy; nothing was changed: try again in a moment", id)


class SearchTimeout(ProtocolError):
    """A search ran past its time budget (CHAT_SEARCH_TIMEOUT_S), or waited for its turn that long."""

    def __init__(self) -> None:
        super().__init__("overloaded", "the search took too long; add words to narrow it, or try again")


class EngineError(ChatError):
    """An engine refused a request or failed; its ``code`` is one of the protocol's."""


class Overloaded(EngineError):
    """The engine's queue is full, or it is shutting down."""

    code, status = "overloaded", 503


class PromptTooLong(EngineError):
    """Even the last user message does not fit in the model's context."""

    code, status = "too_large", 413


class EngineUnavailable(EngineError):
    """The model failed to load."""

    code, status = "internal", 500


class BackendError(EngineError):
    """The remote backend failed while generating."""
