"""The chat.v1 client: a session library (``session``), the command line (``cli``), a load generator (``load``)."""
from __future__ import annotations

from .cli import main
from .load import run_load
from .session import (DEFAULT_URL, EXIT_CONNECT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_TIMEOUT,
                      EXIT_USAGE, Answer, ChatTimeout, ClientError, ConnectFailed, ConnectionLost,
                      ServerError, Session, collect, new_id, ws_url)

__all__ = ["Answer", "ChatTimeout", "ClientError", "ConnectFailed", "ConnectionLost", "DEFAULT_URL",
           "EXIT_CONNECT", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_USAGE",
           "ServerError", "Session", "collect", "main", "new_id", "run_load", "ws_url"]
