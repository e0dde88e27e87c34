"""The WebSocket session library: connect, chat (resuming after drops), cancel; one loop over frames."""
from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import websocket

DEFAULT_URL = "ws://127.0.0.1:8000/ws"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CONNECT, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_CODES = """\
exit status:
  0    the answer arrived (done reason stop or length)
  1    the server sent an error frame, or done with reason error/shutdown
  2    usage error (bad arguments, empty prompt)
  3    cannot connect, handshake refused (401/403), or the connection was lost
  4    timed out waiting for the server (--timeout), or done with reason timeout
  130  interrupted by Ctrl-C (the answer was cancelled on the server first)
"""
POLL_S = 0.2  # how often a waiting recv looks at the cancel flag
RESUME_ATTEMPTS = 5


class ClientError(Exception):
    """An error meant for the user; ``exit_code`` is what the command exits with."""

    exit_code = EXIT_ERROR


class ConnectFailed(ClientError):
    """The socket could not be opened, or the handshake was refused."""

    exit_code = EXIT_CONNECT


class ConnectionLost(ConnectFailed):
    """The socket dropped and could not be resumed."""


class ChatTimeout(ClientError):
    """The server said nothing for longer than the timeout."""

    exit_code = EXIT_TIMEOUT


class ServerError(ClientError):
    """The server answered with an ``error`` frame."""

    def __init__(self, code: str, message: str, id: str | None = None) -> None:
        super().__init__(f"server error {code}: {message}")
        self.code, self.message, self.id = code, message, id


def ws_url(url: str) -> str:
    """Normalise a server address: http(s) becomes ws(s), and a bare host gets ``/ws``."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"unsupported URL scheme {parts.scheme!r} (use ws:// or wss://)")
    path = parts.path if parts.path not in ("", "/") else "/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def new_id(prefix: str = "c") -> str:
    """A fresh request id (protocol: 1-64 chars of ``A-Za-z0-9_-``)."""
    return f"{prefix}{secrets.token_hex(6)}"


class Session:
    """One WebSocket connection speaking ``chat.v1``: connect, ``chat()`` yields frames, cancel.

    The session sends a ``chat_client`` cookie (random unless ``client_id`` is
    given) so that a reconnect is the same client to the server: a dropped
    stream is resumed, and conversations stay reachable.
    """

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None,
                 client_id: str | None = None, timeout: float = 60.0, cancel_wait: float = 5.0,
                 resume: bool = True, on_frame: Callable[[str, str], None] | None = None,
                 source: str | None = None) -> None:
        self.url = ws_url(url)
        if source and not self.url.startswith("ws://"):
            raise ValueError("a source address is for plain ws:// connections only")
        self.source = source  # the local address to connect from (e.g. 127.0.0.2: another client to the server)
        self.api_key = api_key
        self.client_id = client_id or secrets.token_urlsafe(24)
        self.timeout = timeout
        self.cancel_wait = cancel_wait
        self.resume = resume
        self.on_frame = on_frame  # called with ("<" | ">", raw JSON text) for every frame
        self.ws: websocket.WebSocket | None = None
        self.ready: dict | None = None

    def __enter__(self) -> "Session":
        if self.ws is None:
            self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _socket(self) -> socket.socket:
        """A TCP connection to the server from ``self.source``."""
        parts = urlsplit(self.url)
        sock = socket.create_connection((parts.hostname, parts.port or 80), self.timeout,
                                        source_address=(self.source, 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def connect(self) -> dict:
        """Open the socket and wait for ``ready``; returns it."""
        self.close()
        # The key travels in a header, never in the URL (URLs end up in access logs).
        headers = [f"Authorization: Bearer {self.api_key}"] if self.api_key else []
        # Over wss the server reads only the __Host- cookie, which a sibling subdomain cannot plant.
        cookie = "__Host-chat_client" if self.url.startswith("wss://") else "chat_client"
        try:
            options: dict[str, Any] = {"socket": self._socket()} if self.source else {}
            # No Origin: the server allows origin-less (non-browser) clients.
            self.ws = websocket.create_connection(
                self.url, timeout=self.timeout, header=headers, suppress_origin=True,
                cookie=f"{cookie}={self.client_id}", enable_multithread=True, **options)
        except websocket.WebSocketBadStatusException as exc:
            raise ConnectFailed(f"{self.url}: handshake refused: {_status_text(exc)}") from None
        except (OSError, websocket.WebSocketException) as exc:
            raise ConnectFailed(f"cannot connect to {self.url}: {_reason(exc)}") from None
        deadline = time.monotonic() + self.timeout
        frame = None
        while frame is None:
            frame = self.recv(deadline)
        if frame.get("type") != "ready":
            raise ClientError(f"expected a ready frame first, got {frame.get('type')!r}")
        self.ready = frame
        return frame

    def close(self) -> None:
        """Close the socket (active generations keep running for the server's resume grace)."""
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.close(timeout=1)
            except Exception:  # closing a broken socket: nothing left to do
                pass

    def _drop(self) -> None:
        """Forget a socket that has failed or been closed by the server."""
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.shutdown()

    def send(self, frame: dict) -> None:
        """Send one protocol frame."""
        text = json.dumps(frame, ensure_ascii=False)
        if self.on_frame:
            self.on_frame(">", text)
        if self.ws is None:
            raise ConnectionLost("not connected")
        try:
            self.ws.send(text)
        except (OSError, websocket.WebSocketException) as exc:
            self._drop()
            raise ConnectionLost(f"connection lost: {_reason(exc)}") from None

    def recv(self, deadline: float) -> dict | None:
        """The next frame, or None after a short poll; ChatTimeout once ``deadline`` passes."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChatTimeout(f"no answer from the server within {self.timeout:g} s")
        if self.ws is None:
            raise ConnectionLost("not connected")
        self.ws.settimeout(min(POLL_S, remaining))
        try:
            opcode, data = self.ws.recv_data()
        except websocket.WebSocketTimeoutException:
            return None
        except (OSError, websocket.WebSocketException) as exc:
            self._drop()
            raise ConnectionLost(f"connection lost: {_reason(exc)}") from None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            self._drop()
            code = int.from_bytes(data[:2], "big") if len(data) >= 2 else None
            why = data[2:].decode("utf-8", "replace") if len(data) > 2 else ""
            raise ConnectionLost(f"the server closed the connection (code {code}{', ' + why if why else ''})")
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        if self.on_frame:
            self.on_frame("<", text)
        try:
            frame = json.loads(text)
        except ValueError:
            raise ClientError(f"the server sent a frame that is not JSON: {text[:80]!r}") from None
        return frame if isinstance(frame, dict) else {"type": None, "raw": frame}

    def chat(self, content: str, *, conversation_id: str | None = None, system: str | None = None,
             params: dict | None = None, id: str | None = None, attachments: list | None = None,
             cancel: threading.Event | None = None) -> Iterator[dict]:
        """Send a ``chat`` and yield its frames (queued, start, delta…) up to ``done`` or ``error``.

        Setting ``cancel`` sends a ``cancel`` for the request; the frames up to
        its ``done`` (reason ``cancelled``) are still yielded.
        """
        yield from self.request({"type": "chat", "content": content, "conversation_id": conversation_id,
                                 "system": system, "params": params, "attachments": attachments, "id": id},
                                cancel)

    def request(self, frame: dict, cancel: threading.Event | None = None) -> Iterator[dict]:
        """Send any answer-producing request (chat, edit, regenerate, continue) and yield its
        frames like ``chat``; empty optional fields are left out and a missing id is made up."""
        frame = {k: v for k, v in frame.items() if v not in (None, "", {}, [])}
        frame.setdefault("id", new_id())
        self.send(frame)
        yield from self.follow(frame["id"], cancel)

    def follow(self, id: str, cancel: threading.Event | None = None) -> Iterator[dict]:
        """Yield the frames of request ``id`` until its ``done`` or ``error``, resuming after a drop."""
        next_index = 0
        cancelled_at = None
        deadline = time.monotonic() + self.timeout
        while True:
            if cancel is not None and cancel.is_set() and cancelled_at is None:
                cancelled_at = time.monotonic()
                self.cancel(id)
                deadline = min(deadline, cancelled_at + self.cancel_wait)
            try:
                frame = self.recv(deadline)
            except ConnectionLost:
                if not self.resume:
                    raise
                self._reattach(id, next_index)
                deadline = time.monotonic() + self.timeout
                continue
            if frame is None:
                continue
            if cancelled_at is None:
                deadline = time.monotonic() + self.timeout
            kind = frame.get("type")
            if frame.get("id", id) != id or kind in ("pong", "ready", "draining", "title"):
                continue
            if kind == "delta":
                index = frame.get("index", next_index)
                if index < next_index:  # a replay after resume overlapping what we have
                    continue
                next_index = index + 1
            yield frame
            if kind in ("done", "error"):
                return

    def cancel(self, id: str) -> None:
        """Ask the server to stop generating ``id`` (its ``done`` follows)."""
        try:
            self.send({"type": "cancel", "id": id})
        except ConnectionLost:
            pass  # without a resume the server cancels it after its grace period anyway

    def ask(self, content: str, **kwargs) -> dict:
        """Run one chat to the end; returns ``{"text", "done", "start"}`` or raises ServerError."""
        answer = collect(self.chat(content, **kwargs))
        return {"text": answer.text, "start": answer.start, "done": answer.done}

    def _reattach(self, id: str, next_index: int) -> None:
        """Reconnect after a drop and ``resume`` request ``id`` from ``next_index``."""
        last = None
        for attempt in range(RESUME_ATTEMPTS):
            time.sleep(min(0.2 * 2 ** attempt, 2.0))
            try:
                self.connect()
                self.send({"type": "resume", "id": id, "from": next_index})
                return
            except ConnectFailed as exc:
                last = exc
        raise ConnectionLost(f"connection lost and could not resume: {last}")


def _status_text(exc: websocket.WebSocketBadStatusException) -> str:
    """``HTTP 401 Unauthorized: <the server's error message>``."""
    text = f"HTTP {exc.status_code}"
    if getattr(exc, "status_message", None):
        text += f" {exc.status_message}"
    body = getattr(exc, "resp_body", None) or b""
    try:
        detail = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        detail = body.decode("utf-8", "replace").strip()[:200] if isinstance(body, bytes) else ""
    return f"{text}: {detail}" if detail else text


def _reason(exc: BaseException) -> str:
    """A short reason for a socket-level failure."""
    if isinstance(exc, (socket.timeout, websocket.WebSocketTimeoutException)):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


@dataclass
class Answer:
    """What one request's frames came to; times are ``time.perf_counter()`` readings."""

    start: dict | None = None
    done: dict | None = None
    pieces: list = field(default_factory=list)
    thoughts: list = field(default_factory=list)  # a thinking model's thinking, apart from the answer
    first_delta_at: float | None = None
    done_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def thinking(self) -> str:
        return "".join(self.thoughts)


def collect(frames: Iterable[dict], on_delta: Callable[[str], None] | None = None,
            on_thought: Callable[[str], None] | None = None) -> Answer:
    """The one loop over a request's frames (from ``Session.chat``); an ``error`` frame raises ServerError.
    ``on_thought``: each piece of a thinking model's thinking (a delta's ``reasoning``)."""
    answer = Answer()
    for frame in frames:
        kind = frame.get("type")
        if kind == "error":
            raise ServerError(frame.get("code", "?"), frame.get("message", ""), frame.get("id"))
        if kind == "start":
            answer.start = frame
        elif kind == "delta":
            text = frame.get("text", "")
            answer.first_delta_at = answer.first_delta_at or time.perf_counter()
            thought = frame.get("reasoning")
            if isinstance(thought, str) and thought:
                answer.thoughts.append(thought)
                if on_thought is not None:
                    on_thought(thought)
            answer.pieces.append(text)
            if on_delta is not None:
                on_delta(text)
        elif kind == "done":
            answer.done, answer.done_at = frame, time.perf_counter()
    return answer
