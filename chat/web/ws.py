"""The /ws endpoint: the handshake checks, then one session per connection: parse → service → frames."""
from __future__ import annotations

import json
import logging
import threading
from json.encoder import encode_basestring

from flask import Blueprint, Flask, g
from simple_websocket import ConnectionClosed
from wsproto.connection import ConnectionState

from ..app_state import AppState, app_state
from ..concurrency import cooperate
from ..errors import ChatError, ProtocolError, RequestError
from ..limits import TokenBucket
from ..runs import RunHandle
from ..turns import TurnRequest
from . import backpressure, guard, identity, internals
from .protocol import PROTOCOL, Request, error_frame, parse
from .ws_server import BoundedServer, BoundedSock

log = logging.getLogger(__name__)

bp = Blueprint("ws", __name__)
sock = BoundedSock()


def init_app(app: Flask) -> None:
    """Register the WebSocket route."""
    app.register_blueprint(bp)


@bp.before_request
def handshake() -> None:
    """Refuse the upgrade before it happens: origin, API key, per-IP connection limit. The socket
    is counted here, in the same step as the check; the connection gives its place back."""
    state = app_state()
    settings = state.settings
    try:
        guard.check_origin(settings)
        if not guard.key_ok(settings, socket=True):
            raise RequestError("unauthorized", "an API key is required", 401)
        address = guard.address(settings)
        if not state.limits.connect(address):
            raise ProtocolError("rate_limited", "too many connections from this address")
        g.socket_address = address
    except ChatError as exc:  # counted here, answered as JSON by the app's error handler
        state.metrics.errors.labels(exc.code).inc()
        raise


@bp.teardown_request
def _uncount(exc: BaseException | None = None) -> None:
    """A handshake counted but never served (the upgrade failed) gives its place back."""
    address = g.pop("socket_address", None)
    if address is not None:
        app_state().limits.disconnect(address)


@sock.route("/ws", bp=bp)
def websocket(ws: BoundedServer) -> None:
    """Serve one connection until it closes."""
    state = app_state()
    address = g.pop("socket_address")  # this connection now gives the place back itself
    state.metrics.connections.inc()
    session = Session(ws, state, guard.socket_client(), address)
    state.sessions.add(session)
    try:
        session.serve()
    finally:
        if session.client.startswith(identity.ANONYMOUS):
            state.turns.forget_anonymous(session.client, list(session.runs.values()))
        state.sessions.discard(session)
        state.metrics.connections.dec()
        state.limits.disconnect(address)


_DELTA_KEYS = {"type", "id", "index", "text"}
_COUNTED_KEYS = {"type", "id", "index", "text", "tokens"}
RESUME_BURST = 16  # resumes a connection may send at once (a reconnect resumes each open answer)
RESUMES_PER_S = 0.5  # and after that


def encode(frame: dict) -> str:
    """The frame as JSON text, exactly as ``json.dumps(frame, ensure_ascii=False)`` writes it.

    Deltas are nearly every frame, so theirs is written directly (a fifth of dumps' cost).
    """
    keys = frame.keys()
    if (keys == _DELTA_KEYS or keys == _COUNTED_KEYS) and frame["type"] == "delta" and type(frame["index"]) is int:
        head = (f'{{"type": "delta", "id": {encode_basestring(frame["id"])}, "index": {frame["index"]:d}, '
                f'"text": {encode_basestring(frame["text"])}')
        if keys == _DELTA_KEYS:
            return head + "}"
        if keys == _COUNTED_KEYS and type(frame["tokens"]) is int:
            return head + f', "tokens": {frame["tokens"]:d}}}'
    return json.dumps(frame, ensure_ascii=False)


class Session:
    """One WebSocket connection: parse → dispatch to the turn service → send frames."""

    def __init__(self, ws: BoundedServer, state: AppState, client: str, address: str = "?") -> None:
        self.ws, self.state, self.client, self.address = ws, state, client, address
        self.settings, self.turns = state.settings, state.turns
        self.runs: dict[str, RunHandle] = {}  # request id -> run attached to this connection
        # The socket's own write lock when it has one: a pong written by its reader never lands
        # inside one of our frames.
        self.send_lock = getattr(ws, "write_lock", None) or threading.Lock()
        self.send_bound = backpressure.Bound(self.settings.send_timeout_s)  # used under send_lock only
        self.plain = internals.plain_connection(ws)
        self.resumes = TokenBucket(RESUME_BURST, RESUMES_PER_S)
        self.open = True

    def send(self, frame: dict) -> bool:
        """Send one frame; False once the socket is gone."""
        if not self.open:
            return False
        text = encode(frame)
        try:
            with self.send_lock:
                plain = self.plain
                if plain is not None and plain.state is ConnectionState.OPEN and self.ws.connected:
                    data = internals.text_frame(text)
                    sent = internals.send_now(self.ws.sock, data)
                    if sent < len(data):  # the client is behind: wait for room, within the bound
                        with self.send_bound:
                            internals.send_all(self.ws.sock, data[sent:])
                else:  # closing, closed, or compressed: wsproto's own path (it raises or sends nothing)
                    with self.send_bound:
                        self.ws.send(text)
            return True
        except backpressure.SendTimeout:
            log.info("client %s stopped reading for %ss: socket dropped", self.address,
                     self.settings.send_timeout_s)
            self.open = False
            backpressure.cut(self.ws)
            return False
        except Exception:  # ConnectionClosed, or the socket died under us
            self.open = False
            return False

    def serve(self) -> None:
        s = self.settings
        engine = self.state.engine
        limits = {"max_content_chars": s.max_content_chars, "max_new_tokens": s.max_new_tokens,
                  "context_tokens": s.context_tokens, "max_active_per_connection": s.max_active_per_connection,
                  "trash_days": s.trash_days}
        ready: dict[str, object] = {"type": "ready", "protocol": PROTOCOL, "model": engine.model_name,
                                    "models": engine.models(), "limits": limits}
        if engine.thinks():  # a thinking model: the page offers its switch
            ready["thinking"] = True
        if self.state.stopping:  # accepted just as the server began to stop: said at once, and as a frame
            ready["draining"] = True
        self.send(ready)
        if self.state.stopping:
            self.draining()
        try:
            while self.open:
                raw = self.ws.receive()
                if raw is not None and not self.handle(raw):
                    return
                cooperate()  # a client sending fast does not keep the others waiting
        except ConnectionClosed:
            pass
        finally:
            self.open = False
            for run in list(self.runs.values()):
                run.detach(self)

    def handle(self, raw: str | bytes) -> bool:
        """Answer one frame; False when the session should end (``stop``)."""
        req = None
        try:
            req = parse(raw, self.settings.max_content_chars, self.settings.max_new_tokens,
                        self.turns.engine.vocab_size)
            return getattr(self, "on_" + req.type)(req) is not False
        except Exception as exc:  # the one place errors become frames
            if not isinstance(exc, ChatError):
                log.exception("message handling failed")
                exc = ChatError("internal server error")
            frame = error_frame(exc, req.id if req is not None else None)
        self.state.metrics.errors.labels(frame["code"]).inc()
        self.send(frame)
        return True

    # ---- handlers: one per message type (each declares what it reads; protocol.py's table guarantees it)

    def on_ping(self, req: Request) -> None:
        self.send({"type": "pong", "t": req.t} if req.t is not None else {"type": "pong"})

    def on_chat(self, req: TurnRequest) -> None:
        self.turns.chat(self.client, self.address, req, self)

    def on_regenerate(self, req: TurnRequest) -> None:
        self.turns.regenerate(self.client, self.address, req, self)

    def on_edit(self, req: TurnRequest) -> None:
        self.turns.edit(self.client, self.address, req, self)

    def on_continue(self, req: TurnRequest) -> None:
        self.turns.continue_(self.client, self.address, req, self)

    def on_cancel(self, req: TurnRequest) -> None:
        self.turns.cancel(self.client, req.id)

    def on_resume(self, req: Request) -> None:
        # A resume replays the answer so far (a finished one: all of it) for one small frame:
        # a connection gets a few at once, then one every few seconds.
        if not self.resumes.take():
            raise ProtocolError("rate_limited", "too many resumes on this connection; wait a moment", req.id)
        assert req.id is not None  # the message table requires it
        self.turns.resume(self.client, req.id, req.from_index, self)

    def on_stop(self, req: Request) -> bool:
        runs = [r for r in self.runs.values() if not r.finished]
        for run in runs:
            run.cancel("cancelled")
        for run in runs:
            run.wait(10)
        self.close(1000, "stop")
        return False

    def adopt(self, run: RunHandle) -> None:
        """A run now sends its frames here."""
        self.runs[run.id] = run

    def forget(self, run: RunHandle) -> None:
        """The run ended: nothing more comes to this connection."""
        if self.runs.get(run.id) is run:
            del self.runs[run.id]

    def draining(self) -> None:
        """The server stops: running answers may finish, new turns are refused, then 1001 closes the socket."""
        self.send({"type": "draining"})

    def close(self, code: int, reason: str, timeout: float | None = None) -> None:
        self.open = False
        try:
            with backpressure.within(self.settings.send_timeout_s if timeout is None else timeout):
                self.ws.close(code, reason)
        except Exception:  # already gone, or a stalled reader (SendTimeout): tear it down
            backpressure.cut(self.ws)

