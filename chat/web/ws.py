"""The /ws endpoint: one session per connection; runs that outlive a dropped socket."""
from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager

from flask import Blueprint, current_app, jsonify, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from ..concurrency import spawn
from ..engine import GenParams
from ..errors import ProtocolError, StorageFull
from . import backpressure, identity
from .limits import Limits, address_of
from .protocol import PROTOCOL, parse

log = logging.getLogger(__name__)

bp = Blueprint("ws", __name__)
sock = Sock()

CHECKPOINT_EVERY_S = 1.0


def init_app(app) -> None:
    """Register the WebSocket route and the shared run registry."""
    state = app.extensions["chat"]
    state.runs = Runs()
    state.sessions = set()
    state.limits = Limits(state.settings)
    app.register_blueprint(bp)


def _state():
    return current_app.extensions["chat"]


def _refuse(status: int, code: str, message: str):
    return jsonify({"error": {"code": code, "message": message}}), status


def origin_allowed(origin: str, host: str, scheme: str, allowed) -> bool:
    """The page's own origin (exactly its scheme + Host) or one listed in CHAT_ALLOWED_ORIGINS."""
    origin = origin.rstrip("/")
    return origin == f"{scheme}://{host}" or origin in allowed or "*" in allowed


@bp.before_request
def handshake():
    """Refuse the upgrade before it happens: origin, API key, per-IP connection limit."""
    state, settings = _state(), _state().settings
    origin = request.headers.get("Origin")
    if origin is not None:
        scheme = "https" if identity.is_https(request, settings.trusted_proxies) else "http"
        host = identity.public_host(request, settings.trusted_proxies)
        if not origin_allowed(origin, host, scheme, settings.allowed_origins):
            state.metrics.errors.labels("forbidden").inc()
            return _refuse(403, "forbidden", "cross-origin WebSocket refused")
    if settings.api_key and identity.current_client() is None and not identity.has_key(request, settings.api_key):
        return _refuse(401, "unauthorized", "an API key is required")
    if not state.limits.connection_allowed(_address(settings)):
        state.metrics.errors.labels("rate_limited").inc()
        return _refuse(429, "rate_limited", "too many connections from this address")
    return None


@sock.route("/ws", bp=bp)
def websocket(ws):
    """Serve one connection until it closes."""
    state = _state()
    settings = state.settings
    address = _address(settings)
    client = identity.current_client() or identity.ANONYMOUS + identity.new_client_id()
    state.limits.connect(address)
    state.metrics.connections.inc()
    session = Session(ws, state, client, address)
    state.sessions.add(session)
    try:
        session.serve()
    finally:
        if client.startswith(identity.ANONYMOUS):
            spawn(_forget_anonymous, state.store, client, list(session.runs.values()))
        state.sessions.discard(session)
        state.metrics.connections.dec()
        state.limits.disconnect(address)


def _address(settings) -> str:
    """The address the request's limits count against."""
    return address_of(identity.remote_ip(request, settings.trusted_proxies))


def _forget_anonymous(store, client: str, runs) -> None:
    """No one can reach a cookie-less connection's conversations again: delete them once its runs end."""
    for run in runs:
        run.finished_event.wait()
    store.forget_client(client)


def _abandon(gen) -> None:
    """A submitted generation that will not be served: free the engine and consume its events."""
    gen.cancel("cancelled")
    spawn(lambda: [None for _ in gen])


class Runs:
    """Every generation by (client, request id), and which conversations are busy."""

    def __init__(self):
        self.by_id: dict = {}
        self.by_conversation: dict = {}

    def get(self, client: str, rid: str):
        return self.by_id.get((client, rid))

    def active(self, client: str, rid: str) -> bool:
        run = self.get(client, rid)
        return run is not None and not run.finished

    def busy(self, conversation_id: str) -> bool:
        run = self.by_conversation.get(conversation_id)
        return run is not None and not run.finished

    def add(self, run) -> None:
        self.by_id[(run.client, run.id)] = run
        self.by_conversation[run.conversation_id] = run

    def release(self, run) -> None:
        if self.by_conversation.get(run.conversation_id) is run:
            del self.by_conversation[run.conversation_id]

    def forget(self, run) -> None:
        if self.by_id.get((run.client, run.id)) is run:
            del self.by_id[(run.client, run.id)]

    def all_active(self):
        return [r for r in list(self.by_id.values()) if not r.finished]


class Run:
    """One answer: pumps engine events to the store and to whichever session is attached.

    Keeps every delta, so a client that reconnects can ``resume`` from any index
    while the run is going and for a grace period after it ends.
    """

    def __init__(self, state, client, rid, conversation_id, message_id, gen, session):
        self.state, self.client, self.id = state, client, rid
        self.conversation_id, self.message_id, self.gen = conversation_id, message_id, gen
        self.deltas: list[str] = []
        self.done_frame = None
        self.started = False
        self.finished = False
        self.subscriber = session
        self.lock = threading.RLock()
        self.finished_event = threading.Event()
        self.last_checkpoint = time.monotonic()

    def pump(self) -> None:
        """Consume the generation's events until ``done`` (runs in its own greenlet/thread)."""
        try:
            for event in self.gen:
                kind = event["type"]
                if kind == "queued":
                    self.forward({"type": "queued", "id": self.id, "position": event["position"]})
                elif kind == "start":
                    self.send_start()
                elif kind == "delta":
                    self.on_delta(event["text"])
                elif kind == "error":
                    self.on_error(event)
                    return
                elif kind == "done":
                    self.on_done(event)
                    return
        except Exception:
            log.exception("run %s failed", self.id)
            self.gen.cancel("error")
            self.on_done({"type": "done", "reason": "error", "usage": {}, "timings": {}})
        finally:
            self.finish()

    def send_start(self) -> None:
        if not self.started:
            self.started = True
            self.forward({"type": "start", "id": self.id, "conversation_id": self.conversation_id,
                          "message_id": self.message_id})

    def on_delta(self, text: str) -> None:
        with self.lock:
            index = len(self.deltas)
            self.deltas.append(text)
            self.forward({"type": "delta", "id": self.id, "index": index, "text": text})
        now = time.monotonic()
        if now - self.last_checkpoint >= CHECKPOINT_EVERY_S:
            self.last_checkpoint = now
            try:
                self.state.store.save_partial(self.message_id, "".join(self.deltas))
            except StorageFull:
                pass  # a checkpoint is best effort; the answer still streams

    def on_error(self, event: dict) -> None:
        try:
            self.state.store.finish_assistant(self.message_id, "", "error", {}, {})
        except StorageFull:
            pass
        self.state.metrics.errors.labels(event.get("code", "internal")).inc()
        self.forward({"type": "error", "id": self.id, "code": event.get("code", "internal"),
                      "message": event.get("message", "the request failed")})

    def on_done(self, event: dict) -> None:
        self.send_start()  # a request cancelled while queued still gets start, then done
        text = "".join(self.deltas)
        usage = event.get("usage") or {"prompt_tokens": 0, "completion_tokens": 0}
        timings = event.get("timings") or {"ttft_ms": None, "total_ms": 0, "tokens_per_s": 0}
        try:
            self.state.store.finish_assistant(self.message_id, text, event["reason"], usage, timings)
        except StorageFull:
            pass  # logged by the store; the client still gets its answer's end
        self.state.metrics.finished(event)
        extra = {"chars": len(text)}
        if self.state.settings.log_content:
            extra["prompt"] = self.gen.messages[-1]["content"]
            extra["text"] = text
        log.info("generation %s", json.dumps({
            "conversation": self.conversation_id, "id": self.id, "reason": event["reason"],
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "ttft_ms": timings.get("ttft_ms"), "tokens_per_s": timings.get("tokens_per_s"),
            "reused_tokens": event.get("reused_tokens", 0), **extra}))
        if event["reason"] == "error" and event.get("message"):
            log.error("generation %s failed: %s", self.id, event["message"])
        frame = {"type": "done", "id": self.id, "reason": event["reason"], "usage": usage, "timings": timings}
        with self.lock:
            self.done_frame = frame
            self.forward(frame)

    def finish(self) -> None:
        self.finished = True
        self.state.runs.release(self)
        self.finished_event.set()
        if self.subscriber is not None:
            self.subscriber.forget(self)
        spawn(self._expire)

    def _expire(self) -> None:
        time.sleep(self.state.settings.resume_grace_s)
        self.state.runs.forget(self)

    def forward(self, frame: dict) -> None:
        session = self.subscriber
        if session is not None and not session.send(frame):
            self.detach(session)

    def attach(self, session, start: int) -> None:
        """Replay deltas from ``start``, then continue live (or send ``done``)."""
        with self.lock:
            old = self.subscriber
            self.subscriber = None
            if old is not None and old is not session:
                old.forget(self)
            for index in range(start, len(self.deltas)):
                if not session.send({"type": "delta", "id": self.id, "index": index, "text": self.deltas[index]}):
                    return
            if self.done_frame is not None:
                session.send(self.done_frame)
            else:
                self.subscriber = session

    def detach(self, session) -> None:
        """The session went away: cancel after the grace period unless someone resumes."""
        with self.lock:
            if self.subscriber is not session:
                return
            self.subscriber = None
        if not self.finished:
            spawn(self._cancel_unless_resumed)

    def _cancel_unless_resumed(self) -> None:
        time.sleep(self.state.settings.resume_grace_s)
        if self.subscriber is None and not self.finished:
            self.gen.cancel("cancelled")


class Session:
    """One WebSocket connection: parse → dispatch → respond."""

    def __init__(self, ws, state, client: str, address: str = "?"):
        self.ws, self.state, self.client, self.address = ws, state, client, address
        self.settings = state.settings
        self.runs: dict = {}  # request id -> Run attached to this connection
        self.send_lock = threading.Lock()
        self.open = True

    def send(self, frame: dict) -> bool:
        """Send one frame; False once the socket is gone."""
        if not self.open:
            return False
        try:
            with self.send_lock, backpressure.within(self.settings.send_timeout_s):
                self.ws.send(json.dumps(frame, ensure_ascii=False))
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
        engine = self.state.engine
        self.send({"type": "ready", "protocol": PROTOCOL, "model": engine.model_name, "limits": {
            "max_content_chars": self.settings.max_content_chars,
            "max_new_tokens": self.settings.max_new_tokens,
            "context_tokens": self.settings.context_tokens,
            "max_active_per_connection": self.settings.max_active_per_connection}})
        try:
            while self.open:
                raw = self.ws.receive()
                if raw is None:
                    continue
                try:
                    self.dispatch(parse(raw, self.settings.max_content_chars, self.settings.max_new_tokens))
                except ProtocolError as exc:
                    self.state.metrics.errors.labels(exc.code).inc()
                    self.send(exc.frame())
                except _Close:
                    return
                except Exception:
                    log.exception("message handling failed")
                    self.state.metrics.errors.labels("internal").inc()
                    self.send({"type": "error", "code": "internal", "message": "internal server error"})
        except ConnectionClosed:
            pass
        finally:
            self.open = False
            for run in list(self.runs.values()):
                run.detach(self)

    def dispatch(self, req) -> None:
        getattr(self, "on_" + req.type)(req)

    # ---- handlers ----

    def on_ping(self, req) -> None:
        self.send({"type": "pong", "t": req.t} if req.t is not None else {"type": "pong"})

    def on_chat(self, req) -> None:
        store = self.state.store
        self._check_new(req)
        if req.conversation_id is not None:
            if not store.owns(self.client, req.conversation_id):
                raise ProtocolError("not_found", "no such conversation", req.id)
            self._check_busy(req)
            messages = store.history(req.conversation_id)
        else:
            self._check_busy(req)
            messages = [{"role": "system", "content": req.system or self.settings.system_prompt}]
        if not any(m["role"] == "system" for m in messages[:1]):
            messages.insert(0, {"role": "system", "content": self.settings.system_prompt})
        messages.append({"role": "user", "content": req.content})
        gen = self._submit(req, messages, req.conversation_id)
        with self._storing(req, gen):
            if req.conversation_id is None:
                conv = store.create_conversation(self.client, system=req.system or self.settings.system_prompt)
                req.conversation_id = conv["id"]
                gen.key = conv["id"]
            store.add_user_message(self.client, req.conversation_id, req.content)
            self._start_run(req, gen)

    def on_regenerate(self, req) -> None:
        store = self.state.store
        self._check_new(req)
        if not store.owns(self.client, req.conversation_id):
            raise ProtocolError("not_found", "no such conversation", req.id)
        self._check_busy(req)
        history = store.history(req.conversation_id)
        if history and history[-1]["role"] == "assistant":
            history = history[:-1]
        if not history or history[-1]["role"] != "user":
            raise ProtocolError("bad_message", "the conversation has no user message to answer", req.id)
        if history[0]["role"] != "system":
            history.insert(0, {"role": "system", "content": self.settings.system_prompt})
        gen = self._submit(req, history, req.conversation_id)
        with self._storing(req, gen):
            store.drop_last_assistant(self.client, req.conversation_id)
            self._start_run(req, gen)

    def on_cancel(self, req) -> None:
        run = self.state.runs.get(self.client, req.id)
        if run is None:
            raise ProtocolError("unknown_id", f"no request {req.id!r} on this client", req.id)
        run.gen.cancel("cancelled")

    def on_resume(self, req) -> None:
        run = self.state.runs.get(self.client, req.id)
        if run is None:
            raise ProtocolError("unknown_id", f"no request {req.id!r} to resume", req.id)
        self.runs[req.id] = run
        run.attach(self, req.from_index)
        if run.finished:
            self.runs.pop(req.id, None)

    def on_stop(self, req) -> None:
        runs = [r for r in self.runs.values() if not r.finished]
        for run in runs:
            run.gen.cancel("cancelled")
        for run in runs:
            run.finished_event.wait(10)
        try:
            self.ws.close(1000, "stop")
        except Exception:
            pass
        self.open = False
        raise _Close()

    # ---- helpers ----

    def _check_new(self, req) -> None:
        if self.state.runs.active(self.client, req.id):
            raise ProtocolError("duplicate_id", f"request {req.id!r} is already active", req.id)

    def _check_busy(self, req) -> None:
        if req.conversation_id is not None and self.state.runs.busy(req.conversation_id):
            raise ProtocolError("busy", "this conversation is already answering", req.id)

    def _submit(self, req, messages, key):
        ticket = self.state.limits.admit(self.address, self.client, req.id)
        p = req.params
        params = GenParams(temperature=p.get("temperature", self.settings.temperature),
                           top_p=p.get("top_p", self.settings.top_p),
                           max_new_tokens=p.get("max_new_tokens", self.settings.max_new_tokens),
                           seed=p.get("seed"))
        try:
            gen = self.state.engine.submit(messages, params, key=key)
        except Exception as exc:
            ticket.release()
            if isinstance(exc, ProtocolError):
                exc.id = req.id
            raise
        self.state.limits.track(ticket, gen)
        return gen

    @contextmanager
    def _storing(self, req, gen):
        """Store the turn; when the store refuses (quota, full disk), the submitted generation is dropped."""
        try:
            yield
        except ProtocolError as exc:
            _abandon(gen)
            exc.id = req.id
            raise

    def _start_run(self, req, gen) -> None:
        message_id = self.state.store.start_assistant(req.conversation_id)
        run = Run(self.state, self.client, req.id, req.conversation_id, message_id, gen, self)
        self.runs[req.id] = run
        self.state.runs.add(run)
        spawn(run.pump)

    def forget(self, run) -> None:
        """The run ended, or moved to another connection."""
        if self.runs.get(run.id) is run:
            del self.runs[run.id]


class _Close(Exception):
    """The session asked to end (``stop``)."""


def graceful_shutdown(state, timeout: float) -> None:
    """Stop taking requests, let answers finish within ``timeout``, end the rest with ``shutdown``.

    Every partial answer is stored by its run; then the sockets are closed (1001) so the
    worker can exit before its graceful timeout.
    """
    engine = state.engine
    log.info("shutting down: letting %d answers finish", len(state.runs.all_active()))
    engine.drain()
    deadline = time.monotonic() + max(0.0, timeout)
    while state.runs.all_active() and time.monotonic() < deadline:
        time.sleep(0.1)
    engine.shutdown("shutdown")
    deadline = time.monotonic() + 5
    while state.runs.all_active() and time.monotonic() < deadline:
        time.sleep(0.05)
    for session in list(state.sessions):
        session.open = False
        try:
            with backpressure.within(state.settings.send_timeout_s):
                session.ws.close(1001, "server shutting down")
        except Exception:  # a stalled reader (SendTimeout) or a dead socket
            backpressure.cut(session.ws)
