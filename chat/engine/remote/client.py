"""An engine that streams from an OpenAI-compatible backend (vLLM, llama.cpp, TGI, Ollama, this server)."""
from __future__ import annotations

import fnmatch
import http.client
import json
import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from ...concurrency import real_lock, receiver, spawn
from ...config import Settings
from ...errors import PROTOCOL_STATUS, BackendError, ConfigError, EngineError, Overloaded
from ..base import Engine, Generation, GenParams
from ..events import Delta, Done, Refused, Started
from . import fields as remote_fields
from .sse import Body

log = logging.getLogger(__name__)

PROBE_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)
_FINISH = {"stop": "stop", "length": "length"}
AT_CAPACITY = (429, 503)  # the engine's queue is full: the client may retry, as with our own queue
_decode = json.JSONDecoder().raw_decode
WATCH_EVERY_S = 1.0  # the silence watchdog's period (at most a quarter of CHAT_BACKEND_TIMEOUT_S)
# An answer is cut (reason length) past this many bytes per token it may have: an upstream that
# ignores max_tokens, or sends one endless delta, cannot fill the worker's memory or the database.
BYTES_PER_TOKEN = 64
MIN_ANSWER_BYTES = 64 * 1024
MODELS_FRESH_S = 60.0  # how long the backend's model list is used before it is asked again


SALTED = ("chat", "vllm")  # `owned_by` of backends whose prefix cache is kept per `cache_salt`

class _Call:
    """One upstream call (the engine's own state for a generation): its connection, and since
    when its stream read has waited (for the watchdog)."""

    __slots__ = ("gen", "conn", "sock", "waiting_since", "stalled")

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.conn: http.client.HTTPConnection | None = None  # once the call starts
        self.sock: socket.socket | None = None  # once connected (http.client lets go of it at a close)
        self.waiting_since: float | None = None  # None unless blocked reading the stream
        self.stalled = False


REFUSALS = (400, 404, 413, 422)  # the upstream's verdict on the request itself, passed to the client


def _refusal(status: int, body: bytes) -> Refused:
    """An upstream's refusal as the client's own error: its message, and its code where it is one of ours."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code not in PROTOCOL_STATUS or code in ("internal", "overloaded", "rate_limited"):
        code = {413: "too_large", 404: "not_found"}.get(status, "bad_message")
    return Refused(code, _error_text(status, body).replace("backend answered", "the model server refused it:"))


def _error_text(status: int, body: bytes) -> str:
    """A one-line message from an upstream HTTP error, preferring OpenAI's ``error.message``."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:200] or http.client.responses.get(status, "")
    return f"backend answered HTTP {status}: {message}"


class RemoteEngine(Engine):
    """Loads no model: each generation is one streamed ``/chat/completions`` call upstream."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        url = urlsplit(settings.backend_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"CHAT_BACKEND_URL={settings.backend_url!r} is invalid: expected http(s)://host[:port]/v1")
        self._https = url.scheme == "https"
        self._host, self._port, self._base = url.hostname, url.port, url.path
        self.backend_model = settings.backend_model
        self.model_name = settings.model_name or settings.backend_model or "remote"
        self._patterns = [p.strip() for p in settings.backend_models.split(",") if p.strip()]
        self._listed: list[str] = []  # the backend's other models users may pick, from /models
        self.salted = False  # whether the backend takes `cache_salt` (_fetch_models)
        self._listed_at = 0.0
        self._listing = False
        self.ready = False
        self.error: str | None = None
        self._lock = real_lock()
        self._active: dict = {}  # serial -> _Call (dataclass instances are unhashable)
        self._closed = False
        self._probing = False
        self._watching = False
        self._probe()

    # ---- plumbing

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict:
        headers = {"Accept": "application/json", "User-Agent": "chat-remote/1"}
        if self.settings.backend_api_key:
            headers["Authorization"] = f"Bearer {self.settings.backend_api_key}"
        return headers

    def _probe(self) -> None:
        """Ask ``/models`` in the background until the backend answers; then ready."""
        with self._lock:
            if self._probing or self._closed:
                return
            self._probing = True
        spawn(self._probe_loop)

    def _probe_loop(self) -> None:
        attempt = 0
        while not self._closed:
            try:
                self._fetch_models()
                self.ready, self.error = True, None
                log.info("backend %s ready, model %s", self.settings.backend_url, self.backend_model)
                break
            except (OSError, http.client.HTTPException, BackendError, ValueError) as exc:
                self.ready, self.error = False, f"backend {self.settings.backend_url}: {exc}"
                if attempt == 0:
                    log.warning("%s; retrying", self.error)
            time.sleep(PROBE_DELAYS_S[min(attempt, len(PROBE_DELAYS_S) - 1)])
            attempt += 1
        with self._lock:
            self._probing = False

    def _fetch_models(self) -> None:
        conn = self._connection(min(self.settings.backend_timeout_s, 10.0))
        try:
            conn.request("GET", f"{self._base}/models", headers=self._headers())
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise BackendError(_error_text(response.status, body))
            cards = [m for m in json.loads(body).get("data", []) if isinstance(m, dict)]
            models = [m["id"] for m in cards if isinstance(m.get("id"), str) and m["id"]]
        finally:
            conn.close()
        # Backends known to keep their prefix cache per `cache_salt` (this server's engine, vLLM): each
        # client's salt goes with its requests, so the backend shares KV by identity as this server does.
        self.salted = bool(cards) and all(m.get("owned_by") in SALTED for m in cards)
        if not self.backend_model:
            if not models:
                raise BackendError("backend lists no models; set CHAT_BACKEND_MODEL")
            self.backend_model = models[0]
            if not self.settings.model_name:
                self.model_name = models[0]
        self._listed = [m for m in dict.fromkeys(models) if m not in (self.backend_model, self.model_name)
                        and (not self._patterns or any(fnmatch.fnmatchcase(m, p) for p in self._patterns))]
        self._listed_at = time.monotonic()

    def _refresh_models(self) -> None:
        try:
            self._fetch_models()
        except (OSError, http.client.HTTPException, BackendError, ValueError) as exc:
            log.warning("backend %s: listing its models failed: %s", self.settings.backend_url, exc)
        finally:
            self._listing = False

    # ---- the Engine interface

    def models(self) -> list[str]:
        """The default model (``model_name``), then the backend's others that CHAT_BACKEND_MODELS
        allows; a list older than MODELS_FRESH_S is asked for again in the background."""
        with self._lock:
            stale = self.ready and not self._listing and time.monotonic() - self._listed_at > MODELS_FRESH_S
            if stale:
                self._listing = True
        if stale:
            spawn(self._refresh_models)
        return [self.model_name, *self._listed]

    def _upstream_model(self, model: str | None) -> str:
        """The backend's name for a model users named (the default is shown under ``model_name``)."""
        return self.backend_model if model in (None, self.model_name) else model

    def submit(self, messages: list, params: GenParams, key: str | None = None,
               owner: str | None = None) -> Generation:
        """Start one upstream call; events arrive on the returned Generation."""
        if self._closed:
            raise Overloaded("the server is shutting down")
        if params.grammar and not params.upstream:
            raise EngineError("this structured answer needs the local engine", "bad_message", 400)
        with self._lock:
            if len(self._active) >= self.settings.max_batch + self.settings.max_queue:
                raise Overloaded("too many requests in flight to the backend; retry shortly")
            gen = Generation(messages=messages, params=params, key=key, owner=owner, notify=self._abort)
            call = self._active[gen.serial] = _Call(gen)
            watch, self._watching = not self._watching, True
        if watch:
            spawn(self._watch)
        spawn(self._run, call)  # under gevent a greenlet: the patched http.client yields while it waits
        return gen

    def drain(self) -> None:
        """Stop taking new requests; running ones go on."""
        self._closed = True

    def stats(self) -> dict:
        """In-flight upstream calls; the backend keeps its own queue."""
        return {"active": len(self._active), "queued": 0}

    def shutdown(self, reason: str = "shutdown") -> None:
        """Cancel every upstream call and stop probing."""
        self._closed = True
        for call in list(self._active.values()):
            call.gen.cancel(reason)

    def _watch(self) -> None:
        """While calls are in flight: end each stream that has been silent for the backend timeout.

        A streaming read waits with no timeout of its own: under gevent a socket timeout is a timer
        started and stopped around every read, one per delta, which this one loop replaces.
        """
        limit = self.settings.backend_timeout_s
        while True:
            time.sleep(min(WATCH_EVERY_S, limit / 4))
            with self._lock:
                if not self._active:
                    self._watching = False
                    return
                calls = list(self._active.values())
            now = time.monotonic()
            for call in calls:
                since = call.waiting_since
                if since is not None and now - since > limit:
                    call.stalled = True
                    self._shut(call)

    # ---- one generation

    def _abort(self, gen: Generation) -> None:
        """Cancel: shutting the socket down wakes the blocked read and tells the backend to stop."""
        call = self._active.get(gen.serial)
        if call is not None:
            self._shut(call)

    @staticmethod
    def _shut(call: _Call) -> None:
        sock = call.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _body(self, gen: Generation) -> bytes:
        p = gen.params
        if p.raw_prompt:  # /v1/completions: the prompt as is, to the upstream's own /completions
            body = remote_fields.completion_body(p, self._upstream_model(p.model), gen.messages[-1]["content"])
        else:
            body = self._chat_body(gen)
        if p.seed is not None:
            body["seed"] = p.seed
        if p.top_k:  # sent only when set: vLLM, TGI, llama.cpp and Ollama take them; not every backend does
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.stop:
            body["stop"] = list(p.stop)
        if p.cache_salt and self.salted:
            body["cache_salt"] = p.cache_salt
        return json.dumps(body).encode()

    def _chat_body(self, gen: Generation) -> dict:
        p = gen.params
        body = {"model": self._upstream_model(p.model), "messages": remote_fields.messages(gen.messages, p),
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_new_tokens,
                **remote_fields.chat_fields(p)}
        if gen.messages and gen.messages[-1].get("prefix"):
            # continue: backends that know these (vLLM, SGLang) extend the last answer in place.
            body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    def _run(self, call: _Call) -> None:
        gen = call.gen
        t0 = gen.submitted_at
        state: dict[str, Any] = {"first": None, "deltas": 0, "usage": None, "finish": None,
                 "room": max(MIN_ANSWER_BYTES, BYTES_PER_TOKEN * gen.params.max_new_tokens)}
        reason, message = "error", None
        state["relay"] = remote_fields.Relay(gen.messages[-1]["content"] if gen.params.prompt_logprobs is not None
                                             else None, remote_fields.forced(gen.params))
        conn = call.conn = self._connection(self.settings.backend_timeout_s)
        try:
            reason, message = self._call(gen, call, t0, state)
            if reason == "refused":
                log.info("remote generation %s refused by the backend: %s", gen.serial, message)
                return
            if reason == "overloaded":  # before any token: refused, like a full queue here
                log.warning("remote generation %s refused: %s", gen.serial, message)
                gen.emit(Refused("overloaded", "the model server is at capacity; try again shortly"))
                return
        except (OSError, http.client.HTTPException) as exc:
            if gen.cancel_reason:
                reason = gen.cancel_reason
            else:
                message = self._transport_message(TimeoutError() if call.stalled else exc, state)
                if isinstance(exc, ConnectionRefusedError):
                    self.ready = False
                    self._probe()
        except ValueError as exc:
            message = f"backend sent a malformed stream: {exc}"
        except Exception as exc:  # a bug here must still end the stream with done
            log.exception("remote generation failed")
            message = f"remote engine failure: {exc}"
        finally:
            conn.close()
            with self._lock:
                self._active.pop(gen.serial, None)
        if message:
            log.warning("remote generation %s ended with error: %s", gen.serial, message)
        for delta in state["relay"].held():  # cut short (cancel, a dropped stream): what the split held
            gen.emit(delta)
        usage = state["usage"] or {}
        gen.emit(Done.build(reason, usage.get("prompt_tokens", 0), usage.get("completion_tokens", state["deltas"]),
                            t0, state["first"], message=message))

    def _call(self, gen: Generation, call: _Call, t0: float, state: dict[str, Any]) -> tuple[str, str | None]:
        """Send the request and relay its SSE stream; returns (reason, error message)."""
        conn = call.conn
        assert conn is not None  # made by _run
        deadline = t0 + self.settings.generation_timeout_s
        conn.connect()
        sock = call.sock = conn.sock
        if gen.cancel_reason:
            return gen.cancel_reason, None
        path = "completions" if gen.params.raw_prompt else "chat/completions"
        conn.request("POST", f"{self._base}/{path}", self._body(gen),
                     headers={**self._headers(), "Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            if response.status in REFUSALS:  # the upstream refused the request itself: the client's error
                refused = _refusal(response.status, response.read(4096))
                gen.emit(refused)
                return "refused", refused.message
            reason = "overloaded" if response.status in AT_CAPACITY else "error"
            return reason, _error_text(response.status, response.read(4096))
        gen.emit(Started(0))
        sock.settimeout(None)  # from here the watchdog times silence out (see _watch)
        recv = receiver(sock)
        body = Body(response, recv.recv)
        try:
            while True:
                if gen.cancel_reason:
                    return gen.cancel_reason, None
                now = time.monotonic()
                if now > deadline:
                    return "timeout", None
                call.waiting_since = now
                lines = body.read()
                call.waiting_since = None
                if lines is None:
                    if gen.cancel_reason:
                        return gen.cancel_reason, None
                    return "error", self._transport_message(TimeoutError() if call.stalled else None, state)
                for line in lines:
                    if gen.cancel_reason:
                        return gen.cancel_reason, None
                    end = self._line(gen, line, state)
                    if end is not None:
                        return end
        finally:
            recv.close()
            response.close()  # the socket, when the response owns it (an upstream that closes after)

    @staticmethod
    def _line(gen: Generation, line: bytes, state: dict[str, Any]) -> tuple[str, str | None] | None:
        """Relay one SSE line; (reason, error message) when it ends the answer, else None."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return None  # blank separators, comments (keep-alives), event names
        data = line[5:].strip()
        relay = state["relay"]
        if data == b"[DONE]":
            for delta in relay.end():
                gen.emit(delta)
            return _FINISH.get(state["finish"] or "stop", "stop"), None
        text = data.decode()
        chunk, end = _decode(text)  # json.loads without its encoding sniffing and whitespace regexes
        if end != len(text):  # (the line is stripped: anything left is junk, as json.loads says)
            raise ValueError(f"extra data after the JSON: {text[end:end + 40]!r}")
        error = chunk.get("error")
        if error:
            return "error", "backend error: " + str(error.get("message") if isinstance(error, dict) else error)
        if chunk.get("usage"):
            state["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or ():
            for delta in relay.legacy(choice) if "text" in choice else relay.chat(choice):
                if not delta.text:
                    if delta.reasoning:  # thinking is the answer's too: its first token, its count (no usage)
                        state["first"] = state["first"] or time.monotonic()
                        state["deltas"] += 1
                    gen.emit(delta)
                    continue
                text = delta.text
                if state["first"] is None:
                    state["first"] = time.monotonic()
                state["deltas"] += 1
                size = len(text.encode("utf-8", "surrogatepass"))
                state["room"] -= size
                if state["room"] < 0:  # the answer's byte budget: what fits, then the end
                    kept = text.encode("utf-8", "surrogatepass")[:size + state["room"]]
                    text = kept.decode("utf-8", "ignore")
                    if text:
                        gen.emit(Delta(text, delta.logprobs))
                    log.warning("remote generation %s passed its %d bytes: cut", gen.serial,
                                max(MIN_ANSWER_BYTES, BYTES_PER_TOKEN * gen.params.max_new_tokens))
                    return "length", None
                gen.emit(delta)
            if choice.get("finish_reason"):
                state["finish"] = choice["finish_reason"]
        return None

    def _transport_message(self, exc: BaseException | None, state: dict[str, Any]) -> str:
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return f"backend sent nothing for {self.settings.backend_timeout_s:g} s"
        if isinstance(exc, ConnectionRefusedError):
            return f"backend {self.settings.backend_url} refused the connection"
        if state["first"] is not None or state["finish"] is not None:
            return "backend connection dropped mid-answer" + (f" ({exc})" if exc else "")
        return f"backend connection failed: {exc or 'closed before answering'}"
