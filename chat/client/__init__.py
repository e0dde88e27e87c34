"""``python -m chat.client``: a command-line client for the chat WebSocket (one-shot, interactive, load)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator
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

    def __init__(self, code: str, message: str, id: str | None = None):
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
                 resume: bool = True, on_frame: Callable[[str, str], None] | None = None):
        self.url = ws_url(url)
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

    def connect(self) -> dict:
        """Open the socket and wait for ``ready``; returns it."""
        self.close()
        # The key travels in a header, never in the URL (URLs end up in access logs).
        headers = [f"Authorization: Bearer {self.api_key}"] if self.api_key else []
        # Over wss the server reads only the __Host- cookie, which a sibling subdomain cannot plant.
        cookie = "__Host-chat_client" if self.url.startswith("wss://") else "chat_client"
        try:
            # No Origin: the server allows origin-less (non-browser) clients.
            self.ws = websocket.create_connection(
                self.url, timeout=self.timeout, header=headers, suppress_origin=True,
                cookie=f"{cookie}={self.client_id}", enable_multithread=True)
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
             params: dict | None = None, id: str | None = None,
             cancel: threading.Event | None = None) -> Iterator[dict]:
        """Send a ``chat`` and yield its frames (queued, start, delta…) up to ``done`` or ``error``.

        Setting ``cancel`` sends a ``cancel`` for the request; the frames up to
        its ``done`` (reason ``cancelled``) are still yielded.
        """
        frame = {"type": "chat", "id": id or new_id(), "content": content}
        if conversation_id:
            frame["conversation_id"] = conversation_id
        if system:
            frame["system"] = system
        if params:
            frame["params"] = params
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
            if frame.get("id", id) != id or kind in ("pong", "ready"):
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
        pieces, start, done = [], None, None
        for frame in self.chat(content, **kwargs):
            kind = frame.get("type")
            if kind == "error":
                raise ServerError(frame.get("code", "?"), frame.get("message", ""), frame.get("id"))
            if kind == "start":
                start = frame
            elif kind == "delta":
                pieces.append(frame.get("text", ""))
            elif kind == "done":
                done = frame
        return {"text": "".join(pieces), "start": start, "done": done}

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


# ---------------------------------------------------------------- command line

class _Interrupts:
    """SIGINT while an answer streams: the first press requests a cancel, the second quits."""

    def __init__(self):
        self.event = threading.Event()

    def _handler(self, signum, frame):
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    @contextmanager
    def armed(self):
        """Install the handler for the duration of one answer."""
        self.event.clear()
        if threading.current_thread() is not threading.main_thread():
            yield self.event
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self.event
        finally:
            signal.signal(signal.SIGINT, previous)


def _params(args) -> dict:
    """The ``params`` object from the command-line flags (only those given)."""
    params = {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.max_tokens is not None:
        params["max_new_tokens"] = args.max_tokens
    if args.seed is not None:
        params["seed"] = args.seed
    return params


def _check_params(parser: argparse.ArgumentParser, args) -> None:
    """Reject out-of-range values before connecting (the server would say bad_message)."""
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        parser.error("--temperature must be between 0 and 2")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.client_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{16,64}", args.client_id):
        parser.error("--client-id must be 16-64 characters of A-Za-z0-9_-")
    try:
        ws_url(args.url)
    except ValueError as exc:
        parser.error(f"--url: {exc}")


def _common(parser: argparse.ArgumentParser) -> None:
    """Connection and sampling flags shared by chat and load."""
    parser.add_argument("--url", default=os.environ.get("CHAT_URL", DEFAULT_URL),
                        help="server WebSocket URL (default: $CHAT_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("CHAT_API_KEY") or None,
                        help="sent as 'Authorization: Bearer KEY' (default: $CHAT_API_KEY)")
    parser.add_argument("--client-id", default=os.environ.get("CHAT_CLIENT_ID") or None,
                        help="identity cookie to present (16-64 chars of A-Za-z0-9_-); reuse it to "
                             "reach earlier conversations (default: $CHAT_CLIENT_ID, else random)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the connection and for each server message "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print the raw protocol frames the server sends, one JSON object a line")
    parser.add_argument("--system", help="system prompt (for a new conversation)")
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0-2 (0: greedy)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling, (0, 1]")
    parser.add_argument("--max-tokens", type=int, help="most new tokens in the answer")
    parser.add_argument("--seed", type=int, help="sampling seed, for repeatable answers")


def build_parser() -> argparse.ArgumentParser:
    """The parser for chatting (one-shot or interactive)."""
    parser = argparse.ArgumentParser(
        prog="python -m chat.client",
        description="Chat with the server over its WebSocket. With a prompt (or piped stdin) "
                    "print the answer as it streams; with no prompt on a terminal, chat "
                    "interactively (/new: new conversation, /quit: quit; Ctrl-C stops an "
                    "answer, a second Ctrl-C quits). 'python -m chat.client load --help' "
                    "describes the load generator.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="*", help="the question ('-': read it from stdin)")
    parser.add_argument("-i", "--interactive", action="store_true",
                        help="multi-turn chat, even when stdin is not a terminal")
    parser.add_argument("--conversation", metavar="ID",
                        help="continue this conversation (it must belong to --client-id)")
    _common(parser)
    return parser


def build_load_parser() -> argparse.ArgumentParser:
    """The parser for ``load``."""
    parser = argparse.ArgumentParser(
        prog="python -m chat.client load",
        description="Run chats concurrently (one thread and one socket per stream) and report "
                    "time to first delta, tokens/s and errors.",
        epilog=EXIT_CODES.replace("the answer arrived (done reason stop or length)",
                                  "every request succeeded")
                          .replace("the server sent an error frame, or done with reason error/shutdown",
                                   "some request failed (see errors)"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="parallel streams (default: %(default)s)")
    parser.add_argument("--requests", "-n", type=int, default=32, help="chats in all (default: %(default)s)")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.",
                        help="the question each chat asks")
    _common(parser)
    return parser


class _Printer:
    """Writes answers (or raw frames with --json) to stdout, flushing every piece."""

    def __init__(self, raw: bool):
        self.raw = raw
        self.at_line_start = True

    def frame(self, direction: str, text: str) -> None:
        if self.raw and direction == "<":
            _write(text + "\n")

    def text(self, text: str) -> None:
        if not self.raw and text:
            _write(text)
            self.at_line_start = text.endswith("\n")

    def end(self) -> None:
        if not self.raw and not self.at_line_start:
            _write("\n")
        self.at_line_start = True


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _say(message: str) -> None:
    """One line for the user on stderr."""
    print(f"chat.client: {message}", file=sys.stderr, flush=True)


def _stream(session: Session, printer: _Printer, interrupts: _Interrupts, prompt: str,
            **kwargs) -> tuple[dict | None, dict | None, bool]:
    """Print one answer as it streams; returns (start, done, whether the user cancelled)."""
    start = done = None
    with interrupts.armed() as cancel:
        try:
            for frame in session.chat(prompt, cancel=cancel, **kwargs):
                kind = frame.get("type")
                if kind == "start":
                    start = frame
                elif kind == "delta":
                    printer.text(frame.get("text", ""))
                elif kind == "done":
                    done = frame
                elif kind == "error":
                    printer.end()
                    raise ServerError(frame.get("code", "?"), frame.get("message", ""), frame.get("id"))
        except ChatTimeout:
            if not cancel.is_set():
                raise
        finally:
            printer.end()
        return start, done, cancel.is_set()


def _exit_for(done: dict | None, cancelled: bool) -> int:
    """Map how an answer ended to the exit status."""
    reason = (done or {}).get("reason")
    if cancelled:
        return EXIT_INTERRUPTED
    if reason in ("stop", "length"):
        return EXIT_OK
    if reason == "timeout":
        _say("the answer was cut short by the server's generation time limit")
        return EXIT_TIMEOUT
    _say(f"the answer ended with reason {reason!r}")
    return EXIT_ERROR


def _one_shot(session: Session, printer: _Printer, args, prompt: str) -> int:
    """Ask one question, stream the answer, exit."""
    interrupts = _Interrupts()
    try:
        session.connect()
        _, done, cancelled = _stream(session, printer, interrupts, prompt,
                                     conversation_id=args.conversation,
                                     system=None if args.conversation else args.system,
                                     params=_params(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        session.close()
    return _exit_for(done, cancelled)


def _interactive(session: Session, printer: _Printer, args, first: str | None) -> int:
    """A multi-turn chat at a ``> `` prompt."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    try:
        ready = session.connect()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if sys.stdin.isatty():
        _say(f"connected to {ready.get('model', '?')}; /new starts a new conversation, /quit quits, "
             "Ctrl-C stops an answer")
    interrupts = _Interrupts()
    conversation = args.conversation
    system = None if conversation else args.system
    try:
        while True:
            if first is not None:
                line, first = first, None
            else:
                try:
                    if printer.raw:  # keep stdout pure JSON
                        sys.stderr.write("> ")
                        sys.stderr.flush()
                    line = input("" if printer.raw else "> ")
                except EOFError:
                    printer.end()
                    return EXIT_OK
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit", "/q"):
                return EXIT_OK
            if line == "/new":
                conversation = None
                system = args.system
                _say("new conversation")
                continue
            if line == "/help":
                _say("/new: new conversation, /quit: quit; Ctrl-C stops an answer, twice quits")
                continue
            try:
                if session.ws is None:
                    session.connect()
                start, done, cancelled = _stream(session, printer, interrupts, line,
                                                 conversation_id=conversation, system=system,
                                                 params=_params(args))
            except ServerError as exc:
                _say(str(exc))
                if exc.code == "not_found" and conversation:
                    _say("that conversation is not this client's (see --client-id)")
                continue
            except ClientError as exc:
                _say(str(exc))
                continue
            if start and start.get("conversation_id"):
                conversation = start["conversation_id"]
                system = None  # the system prompt belongs to the conversation now
            if cancelled:
                _say("cancelled (Ctrl-C again to quit)")
            elif done and done.get("reason") not in ("stop", "length"):
                _say(f"the answer ended with reason {done.get('reason')!r}")
    except KeyboardInterrupt:
        printer.end()
        return EXIT_OK
    finally:
        session.close()


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_load(url: str, *, concurrency: int, requests: int, prompt: str, params: dict | None = None,
             system: str | None = None, timeout: float = 60.0, api_key: str | None = None) -> dict:
    """Run ``requests`` chats over ``concurrency`` sockets; returns the summary (see ``load``)."""
    lock = threading.Lock()
    counter = iter(range(requests))
    results: list[dict] = []

    def take() -> int | None:
        with lock:
            return next(counter, None)

    def worker() -> None:
        session = Session(url, api_key=api_key, timeout=timeout)
        try:
            while take() is not None:
                row = None
                if session.ws is None:  # first use, or the last request lost the socket
                    try:
                        session.connect()
                    except ChatTimeout as exc:
                        row = {"ok": False, "error": "timeout", "message": str(exc)}
                    except ClientError as exc:
                        row = {"ok": False, "error": "connect", "message": str(exc)}
                row = row or _one_load_request(session, prompt, params, system)
                with lock:
                    results.append(row)
        finally:
            session.close()

    started = time.monotonic()
    threads = [threading.Thread(target=worker, name=f"load-{n}", daemon=True)
               for n in range(min(concurrency, requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return _summary(results, wall, concurrency, requests)


def _one_load_request(session: Session, prompt: str, params: dict | None, system: str | None) -> dict:
    """One timed chat; the result row ``run_load`` aggregates."""
    sent = time.monotonic()
    first = None
    deltas = 0
    try:
        for frame in session.chat(prompt, params=params or None, system=system):
            kind = frame.get("type")
            if kind == "delta":
                deltas += 1
                if first is None:
                    first = time.monotonic()
            elif kind == "error":
                return {"ok": False, "error": frame.get("code", "?"), "message": frame.get("message", "")}
            elif kind == "done":
                end = time.monotonic()
                reason = frame.get("reason")
                tokens = (frame.get("usage") or {}).get("completion_tokens") or deltas
                row = {"ok": reason in ("stop", "length"), "reason": reason, "tokens": tokens,
                       "deltas": deltas, "total_s": end - sent,
                       "ttft_s": None if first is None else first - sent,
                       "decode_tokens_per_s": (tokens - 1) / (end - first)
                       if first is not None and tokens > 1 and end > first else None}
                if not row["ok"]:
                    row["error"] = f"done:{reason}"
                return row
    except ChatTimeout as exc:
        return {"ok": False, "error": "timeout", "message": str(exc)}
    except ConnectFailed as exc:
        return {"ok": False, "error": "connection_lost", "message": str(exc)}
    except ClientError as exc:
        return {"ok": False, "error": "client", "message": str(exc)}
    return {"ok": False, "error": "no_done", "message": "the stream ended without done"}


def _summary(results: list[dict], wall: float, concurrency: int, requests: int) -> dict:
    """Aggregate per-request rows into the load report."""
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] * 1000 for r in ok if r.get("ttft_s") is not None]
    rates = [r["decode_tokens_per_s"] for r in ok if r.get("decode_tokens_per_s") is not None]
    tokens = sum(r.get("tokens", 0) for r in results if "tokens" in r)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    rnd = lambda v, n=1: None if v is None else round(v, n)  # noqa: E731
    return {
        "requests": requests, "concurrency": concurrency, "ok": len(ok),
        "failed": len(results) - len(ok), "wall_s": rnd(wall, 3),
        "ttft_ms": {"p50": rnd(_percentile(ttfts, 50)), "p95": rnd(_percentile(ttfts, 95)),
                    "max": rnd(max(ttfts) if ttfts else None)},
        "stream_tokens_per_s": {"p50": rnd(_percentile(rates, 50)),
                                "min": rnd(min(rates) if rates else None),
                                "max": rnd(max(rates) if rates else None),
                                "mean": rnd(sum(rates) / len(rates) if rates else None)},
        "completion_tokens": tokens,
        "aggregate_tokens_per_s": rnd(tokens / wall if wall > 0 else None),
        "errors": errors,
    }


def _print_summary(s: dict) -> None:
    """The human-readable load report."""
    fmt = lambda v, unit="": "-" if v is None else f"{v:g}{unit}"  # noqa: E731
    t, r = s["ttft_ms"], s["stream_tokens_per_s"]
    print(f"requests: {s['ok']} ok, {s['failed']} failed of {s['requests']} "
          f"(concurrency {s['concurrency']}) in {s['wall_s']:.2f} s")
    print(f"time to first delta: p50 {fmt(t['p50'], ' ms')}  p95 {fmt(t['p95'], ' ms')}  "
          f"max {fmt(t['max'], ' ms')}")
    print(f"tokens/s per stream (after the first delta): p50 {fmt(r['p50'])}  min {fmt(r['min'])}  "
          f"max {fmt(r['max'])}  mean {fmt(r['mean'])}")
    print(f"aggregate: {s['completion_tokens']} tokens, {fmt(s['aggregate_tokens_per_s'])} tokens/s")
    errors = ", ".join(f"{k}={v}" for k, v in sorted(s["errors"].items())) or "none"
    print(f"errors: {errors}")


def _load_main(argv: list[str]) -> int:
    """``python -m chat.client load ...``."""
    parser = build_load_parser()
    args = parser.parse_args(argv)
    _check_params(parser, args)
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be at least 1")
    try:
        summary = run_load(args.url, concurrency=args.concurrency, requests=args.requests,
                           prompt=args.prompt, params=_params(args), system=args.system,
                           timeout=args.timeout, api_key=args.api_key)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        _print_summary(summary)
    if summary["ok"] == summary["requests"]:
        return EXIT_OK
    if summary["errors"].get("connect") == summary["requests"]:
        _say(f"cannot connect to {ws_url(args.url)}")
        return EXIT_CONNECT
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["load"]:
            return _load_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        _check_params(parser, args)
        prompt = " ".join(args.prompt).strip() or None
        if args.prompt == ["-"] or (prompt is None and not args.interactive and not sys.stdin.isatty()):
            prompt = sys.stdin.read().strip()
            if not prompt:
                parser.error("the prompt read from stdin is empty")
        printer = _Printer(args.json)
        session = Session(args.url, api_key=args.api_key, client_id=args.client_id,
                          timeout=args.timeout, on_frame=printer.frame)
        if args.interactive or prompt is None:
            return _interactive(session, printer, args, prompt)
        return _one_shot(session, printer, args, prompt)
    except ClientError as exc:
        _say(str(exc))
        return exc.exit_code
    except BrokenPipeError:
        # stdout went away (e.g. `| head`): stop quietly, without a second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED

