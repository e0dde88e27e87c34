"""OpenAI-compatible HTTP API: ``GET /v1/models`` and ``POST /v1/chat/completions``."""
from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from ..engine import GenParams
from ..errors import ProtocolError
from . import identity
from .limits import address_of

log = logging.getLogger(__name__)

bp = Blueprint("openai_api", __name__, url_prefix="/v1")

MAX_BODY_BYTES = 16 * 1024 * 1024
KEEPALIVE_S = 15.0  # an SSE comment while nothing else is sent: proxies stay open, gone clients are noticed
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               502: "server_error", 503: "server_error"}
_STARTED = int(time.time())


class ApiError(ProtocolError):
    """A request the API refuses; knows the offending ``param`` for OpenAI's error shape."""

    def __init__(self, code: str, message: str, param: str | None = None, status: int = 400):
        super().__init__(code, message)
        self.param = param
        self._status = status

    @property
    def status(self) -> int:
        return self._status


def _error_response(status: int, message: str, param=None, code=None, headers=None) -> Response:
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


@bp.errorhandler(ProtocolError)
def _protocol_error(exc: ProtocolError):
    """Every refusal leaves in OpenAI's error shape."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return _error_response(exc.status, exc.message, getattr(exc, "param", None), exc.code, headers)


@bp.errorhandler(RequestEntityTooLarge)
def _body_too_large(exc):
    """Bodies over MAX_BODY_BYTES."""
    return _error_response(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="too_large")


def _state():
    return current_app.extensions["chat"]


@bp.before_request
def _authorize():
    """With CHAT_API_KEY set, every /v1 call needs ``Authorization: Bearer <key>``."""
    key = _state().settings.api_key
    if not key:
        return None
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError("invalid_api_key", "missing or invalid API key (use Authorization: Bearer <key>)",
                       status=401)
    return None


def _engine_ready():
    engine = _state().engine
    if not engine.ready:  # the load error names paths and URLs: it stays in the log
        raise ApiError("model_not_ready", "the model is not ready yet", status=503)
    return engine


# ---- validation: one parser per field, each (value, name, settings) -> value or ApiError

def _bad(name: str, message: str) -> ApiError:
    return ApiError("invalid_value", f"'{name}' {message}", name, status=400)


def _number(low: float, high: float, low_open: bool = False):
    def parse(value, name, settings):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(name, "must be a number")
        if value < low or value > high or (low_open and value == low):
            raise _bad(name, f"must be in {'(' if low_open else '['}{low}, {high}]")
        return float(value)
    return parse


def _integer(low: int, high: int | None = None):
    def parse(value, name, settings):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(name, "must be an integer")
        if value < low or (high is not None and value > high):
            raise _bad(name, f"must be >= {low}" if high is None else f"must be in [{low}, {high}]")
        return value
    return parse


def _boolean(value, name, settings):
    if not isinstance(value, bool):
        raise _bad(name, "must be a boolean")
    return value


def _string(value, name, settings):
    if not isinstance(value, str):
        raise _bad(name, "must be a string")
    return value


def _n(value, name, settings):
    _integer(1)(value, name, settings)
    if value != 1:
        raise ApiError("unsupported_value", "'n' must be 1: this server returns one choice per request",
                       name, status=400)
    return value


def _stop(value, name, settings):
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad(name, "must be a non-empty string or a list of them")
    if len(stops) > 4:
        raise _bad(name, "may hold at most 4 sequences")
    return tuple(stops)


def _stream_options(value, name, settings):
    if not isinstance(value, dict):
        raise _bad(name, "must be an object")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise _bad(f"{name}.include_usage", "must be a boolean")
    return {"include_usage": include}


def _content(value, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError("unsupported_content", f"'{name}[{i}]' must be a {{\"type\": \"text\", "
                               "\"text\": ...}} part: only text is supported", f"{name}[{i}]", status=400)
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(name, "must be a string or a list of text parts")


def _messages(value, name, settings):
    if not isinstance(value, list) or not value:
        raise _bad(name, "must be a non-empty list")
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}, not {role!r}")
        text = _content(message.get("content"), f"{where}.content")
        if len(text) > settings.max_content_chars:
            raise ApiError("too_large", f"'{where}.content' is longer than {settings.max_content_chars} "
                           "characters", f"{where}.content", status=413)
        out.append({"role": _ROLES[role], "content": text})
    return out


def _unsupported(message: str):
    def parse(value, name, settings):
        if value not in (False, [], {"type": "text"}):
            raise ApiError("unsupported_parameter", f"'{name}' is not supported: {message}", name, status=400)
        return value
    return parse


FIELDS = {
    "messages": _messages,
    "model": _string,
    "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0, low_open=True),
    "max_tokens": _integer(1),
    "max_completion_tokens": _integer(1),
    "seed": _integer(*SEED_RANGE),
    "stop": _stop,
    "n": _n,
    "stream": _boolean,
    "stream_options": _stream_options,
    "tools": _unsupported("this server has no tool calling"),
    "functions": _unsupported("this server has no function calling"),
    "logprobs": _unsupported("this server returns no log probabilities"),
    "response_format": _unsupported("only plain text answers"),
}
REQUIRED = ("messages",)


def parse_request(body, settings) -> dict:
    """Validate a chat.completions body; null counts as absent, unknown fields are ignored."""
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object", status=400)
    values = {name: parse(body[name], name, settings)
              for name, parse in FIELDS.items() if body.get(name) is not None}
    for name in REQUIRED:
        if name not in values:
            raise _bad(name, "is required")
    return values


def gen_params(values: dict, settings) -> GenParams:
    """Sampling parameters: request values, else the server's defaults; max tokens capped."""
    wanted = values.get("max_completion_tokens", values.get("max_tokens", settings.max_new_tokens))
    return GenParams(temperature=values.get("temperature", settings.temperature),
                     top_p=values.get("top_p", settings.top_p),
                     max_new_tokens=min(wanted, settings.max_new_tokens),
                     seed=values.get("seed"), stop=values.get("stop", ()))


def with_system_prompt(messages: list, system_prompt: str) -> list:
    """The server's system prompt goes first when the request brings none."""
    if system_prompt and not any(m["role"] == "system" for m in messages):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _read_json():
    request.max_content_length = MAX_BODY_BYTES
    raw = request.get_data(cache=False)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError("invalid_json", f"the request body is not valid JSON: {exc}", status=400) from None
    except RecursionError:
        raise ApiError("invalid_json", "the request body nests too deeply", status=400) from None


# ---- routes

def _model_card(engine) -> dict:
    return {"id": engine.model_name, "object": "model", "created": _STARTED, "owned_by": "chat"}


@bp.get("/models")
def list_models():
    """The one model this server serves (503 until it is ready)."""
    return jsonify({"object": "list", "data": [_model_card(_engine_ready())]})


@bp.get("/models/<path:model_id>")
def get_model(model_id):
    """One model by id."""
    engine = _engine_ready()
    if model_id != engine.model_name:
        raise ApiError("model_not_found", f"the model '{model_id}' does not exist", "model", status=404)
    return jsonify(_model_card(engine))


@bp.post("/chat/completions")
def chat_completions():
    """Answer a conversation, streamed as SSE chunks or as one JSON object."""
    state = _state()
    settings = state.settings
    values = parse_request(_read_json(), settings)
    engine = _engine_ready()
    messages = with_system_prompt(values["messages"], settings.system_prompt)
    gen = _submit(state, engine, messages, gen_params(values, settings))
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
    metrics = getattr(state, "metrics", None)
    if values.get("stream"):
        include_usage = values.get("stream_options", {}).get("include_usage", False)
        return Response(_stream(gen, meta, include_usage, metrics), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return _complete(gen, meta, metrics)


def _submit(state, engine, messages, params):
    """Admit the request against its address's limits (when the app has them), then submit it."""
    limits = getattr(state, "limits", None)
    if limits is None:
        return engine.submit(messages, params)
    ticket = limits.admit(address_of(identity.remote_ip(request, state.settings.trusted_proxies)))
    try:
        gen = engine.submit(messages, params)
    except Exception:
        ticket.release()
        raise
    limits.track(ticket, gen)
    return gen


def _usage(done: dict) -> dict:
    usage = done.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(done: dict, request_id: str) -> ApiError:
    """An answer refused by the engine (an ``error`` event) or ended by shutdown or an engine error.

    An engine failure's own message may carry the backend's URL or body: the client gets a
    generic message with the request id, and the log line under that id has the details.
    """
    if done["type"] == "error":
        status = ProtocolError.http_status.get(done.get("code"), 400)
        return ApiError(done.get("code") or "internal", done.get("message") or "the request failed", status=status)
    if done["reason"] == "shutdown":
        return ApiError("shutdown", "the server is shutting down", status=503)
    log.error("v1 %s failed: %s", request_id, done.get("message") or "no detail")
    return ApiError("internal", f"the engine failed while generating (request id {request_id})", status=500)


def _record(meta: dict, done: dict, streamed: bool, metrics) -> None:
    """Log the outcome and count it in the server's metrics."""
    if metrics is not None:
        if done["type"] == "done":
            metrics.finished(done)
        else:
            metrics.errors.labels(done.get("code") or "internal").inc()
    usage, timings = done.get("usage") or {}, done.get("timings") or {}
    log.info("v1 %s reason=%s stream=%s prompt_tokens=%s completion_tokens=%s total_ms=%s",
             meta["id"], done.get("reason") or f"refused:{done.get('code')}", streamed,
             usage.get("prompt_tokens"), usage.get("completion_tokens"), timings.get("total_ms"))


def _complete(gen, meta: dict, metrics=None):
    """Wait for the whole answer; one ``chat.completion`` object."""
    texts, done = [], None
    try:
        while done is None:
            event = gen.next_event()
            if event["type"] == "delta":
                texts.append(event["text"])
            elif event["type"] in ("done", "error"):
                done = event
    finally:
        gen.cancel()  # a no-op once done; frees the engine if this greenlet is killed
        gen.close()
    _record(meta, done, False, metrics)
    if done.get("reason") not in _FINISH:
        raise _failure(done, meta["id"])
    return jsonify({**meta, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                                 "logprobs": None, "finish_reason": _FINISH[done["reason"]]}],
                    "usage": _usage(done)})


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(gen, meta: dict, include_usage: bool, metrics=None):
    """SSE chunks as the engine makes them; leaving early (client gone) cancels the generation."""
    def chunk(delta, finish=None):
        out = {**meta, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return _sse(out)

    done = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        while done is None:
            event = gen.next_event(KEEPALIVE_S)
            if event is None:
                yield ": keep-alive\n\n"
            elif event["type"] == "delta" and event["text"]:
                yield chunk({"content": event["text"]})
            elif event["type"] in ("done", "error"):
                done = event
        _record(meta, done, True, metrics)
        if done.get("reason") in _FINISH:
            yield chunk({}, _FINISH[done["reason"]])
            if include_usage:
                yield _sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(done)})
        else:
            failure = _failure(done, meta["id"])
            yield _sse({"error": {"message": failure.message, "type": _ERROR_TYPE[failure.status],
                                  "param": None, "code": failure.code}})
        yield "data: [DONE]\n\n"
    finally:
        if done is None:
            log.info("v1 %s client closed the stream; generation cancelled", meta["id"])
            gen.cancel()
            if metrics is not None:
                metrics.finished({"type": "done", "reason": "cancelled"})
        gen.close()
