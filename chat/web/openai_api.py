"""OpenAI-compatible HTTP API: ``GET /v1/models`` and ``POST /v1/chat/completions``."""
from __future__ import annotations

import json
import logging
import time
import uuid
from json.encoder import encode_basestring

from typing import TYPE_CHECKING, Any, Iterator

from flask import Blueprint, Response, jsonify, request

from .. import params as sampling
from ..app_state import app_state
from ..config import Settings
from ..engine import Generation
from ..engine.events import Delta, Done, Refused
from ..errors import PROTOCOL_STATUS, ChatError, EngineError, RequestError
from . import guard, json_input, openai_tools

if TYPE_CHECKING:
    from ..turns import TurnService

log = logging.getLogger(__name__)

bp = Blueprint("openai_api", __name__, url_prefix="/v1")

MAX_BODY_BYTES = 16 * 1024 * 1024
KEEPALIVE_S = 15.0  # an SSE comment while nothing else is sent: proxies stay open, gone clients are noticed
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
_STARTED = int(time.time())
_MARK = "@@chat-content@@"  # stands for a delta's text in the prebuilt chunk


@bp.before_request
def _authorize():
    """With CHAT_API_KEY set, every /v1 call needs ``Authorization: Bearer <key>``."""
    settings = app_state().settings
    if not guard.key_ok(settings, socket=False):
        raise RequestError("invalid_api_key", "missing or invalid API key (use Authorization: Bearer <key>)", 401)
    guard.check_write(settings, "invalid_json")


def _engine_ready():
    engine = app_state().engine
    if not engine.ready:  # the load error names paths and URLs: it stays in the log
        raise RequestError("model_not_ready", "the model is not ready yet", 503)
    return engine


# ---- validation: one parser per field, each (value, name, settings) -> value or RequestError

def _bad(name: str, message: str) -> RequestError:
    return RequestError("invalid_value", f"'{name}' {message}", 400, name)


def _integer(low: int, high: int | None = None):
    def parse(value: Any, name: str, settings: Settings) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(name, "must be an integer")
        if value < low or (high is not None and value > high):
            raise _bad(name, f"must be >= {low}" if high is None else f"must be in [{low}, {high}]")
        return value
    return parse


def _boolean(value: Any, name: str, settings: Settings) -> Any:
    if not isinstance(value, bool):
        raise _bad(name, "must be a boolean")
    return value


def _string(value: Any, name: str, settings: Settings) -> Any:
    if not isinstance(value, str):
        raise _bad(name, "must be a string")
    return value


def _n(value: Any, name: str, settings: Settings) -> Any:
    _integer(1)(value, name, settings)
    if value != 1:
        raise RequestError("unsupported_value", "'n' must be 1: this server returns one choice per request",
                           400, name)
    return value


def _stop(value: Any, name: str, settings: Settings) -> Any:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad(name, "must be a non-empty string or a list of them")
    if len(stops) > 4:
        raise _bad(name, "may hold at most 4 sequences")
    return tuple(stops)


def _stream_options(value: Any, name: str, settings: Settings) -> Any:
    if not isinstance(value, dict):
        raise _bad(name, "must be an object")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise _bad(f"{name}.include_usage", "must be a boolean")
    return {"include_usage": include}


def _content(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("unsupported_content", f"'{name}[{i}]' must be a {{\"type\": \"text\", "
                                   "\"text\": ...}} part: only text is supported", 400, f"{name}[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(name, "must be a string or a list of text parts")


def _sampling(value: Any, name: str, settings: Settings) -> Any:
    """A sampling parameter, by the rules every transport shares (chat/params.py)."""
    if name == "top_k" and value == -1 and not isinstance(value, bool):
        value = 0  # -1, other servers' "off", means off here too
    what = sampling.check(name, value)
    if what is not None:
        raise _bad(name, f"must be {what}")
    return float(value) if name in ("temperature", "top_p", "min_p") else value


def _too_large(name: str, message: str) -> RequestError:
    return RequestError("too_large", f"'{name}' {message}", 413, name)


def _messages(value: Any, name: str, settings: Settings) -> Any:
    if not isinstance(value, list) or not value:
        raise _bad(name, "must be a non-empty list")
    if settings.max_messages and len(value) > settings.max_messages:
        raise _too_large(name, f"holds more than {settings.max_messages} messages")
    out, chars = [], 0
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}, not {role!r}")
        text = _content(message.get("content"), f"{where}.content")
        if len(text) > settings.max_content_chars:
            raise _too_large(f"{where}.content", f"is longer than {settings.max_content_chars} characters")
        chars += len(text)
        if chars > settings.max_request_chars:
            raise _too_large(name, f"hold more than {settings.max_request_chars} characters in all")
        out.append({"role": _ROLES[role], "content": text})
        thought = message.get("reasoning_content")
        if _ROLES[role] == "assistant" and thought is not None:  # a thinking model's earlier thinking
            if not isinstance(thought, str):
                raise _bad(f"{where}.reasoning_content", "must be a string")
            chars += len(thought)
            if chars > settings.max_request_chars:
                raise _too_large(name, f"hold more than {settings.max_request_chars} characters in all")
            if thought:
                out[-1]["reasoning_content"] = thought
    return out


def _salt(value: Any, name: str, settings: Settings) -> Any:
    """vLLM's ``cache_salt``: whose KV the prompt may reuse (a web tier in front names its client's)."""
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise _bad(name, "must be a string of 1-64 characters")
    return "salt:" + value  # never one of this server's own namespaces


def _template_kwargs(value: Any, name: str, settings: Settings) -> Any:
    """vLLM's (and llama.cpp's server's) ``chat_template_kwargs``: of them, ``enable_thinking`` (a thinking
    model's switch) is read; other keys are ignored, as a template without them would."""
    if not isinstance(value, dict):
        raise _bad(name, "must be an object")
    flag = value.get("enable_thinking")
    if flag is not None and not isinstance(flag, bool):
        raise _bad(f"{name}.enable_thinking", "must be a boolean")
    return {"enable_thinking": flag} if flag is not None else {}


def _unsupported(message: str):
    def parse(value: Any, name: str, settings: Settings) -> Any:
        if value not in (False, [], {"type": "text"}):
            raise RequestError("unsupported_parameter", f"'{name}' is not supported: {message}", 400, name)
        return value
    return parse


FIELDS = {
    "messages": _messages,
    "model": _string,
    "temperature": _sampling,
    "top_p": _sampling,
    "top_k": _sampling,
    "min_p": _sampling,
    "max_tokens": _integer(1),
    "max_completion_tokens": _integer(1),
    "seed": _sampling,
    "stop": _stop,
    "n": _n,
    "stream": _boolean,
    "stream_options": _stream_options,
    "functions": _unsupported("use 'tools'"),
    "cache_salt": _salt,
    "chat_template_kwargs": _template_kwargs,
    "enable_thinking": _boolean,  # the same switch at the top level, as Qwen's own cloud API (DashScope) takes it
}
# checked together, by openai_tools.plan: tools, tool_choice, parallel_tool_calls, response_format,
# logprobs, top_logprobs
FIELDS["messages"] = lambda value, name, settings: _messages(openai_tools.messages(value), name, settings)
REQUIRED = ("messages",)


def parse_request(body: Any, settings: Settings, vocab: int | None = None) -> dict:
    """Validate a chat.completions body; null counts as absent, unknown fields are ignored.
    ``vocab``: the model's vocabulary when known (top_k's bound)."""
    if not isinstance(body, dict):
        raise RequestError("invalid_request", "the request body must be a JSON object")
    values = {name: parse(body[name], name, settings)
              for name, parse in FIELDS.items() if body.get(name) is not None}
    for name in REQUIRED:
        if name not in values:
            raise _bad(name, "is required")
    what = sampling.check("top_k", values["top_k"], vocab=vocab) if "top_k" in values else None
    if what is not None:
        raise _bad("top_k", f"must be {what}: the model's vocabulary")
    return values


def gen_params(values: dict) -> dict:
    """The request's sampling values under the engine's names (the service fills in defaults)."""
    out = {k: values[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "cache_salt")
           if k in values}
    thinking = values.get("chat_template_kwargs", {}).get("enable_thinking", values.get("enable_thinking"))
    if thinking is not None:
        out["enable_thinking"] = thinking
    wanted = values.get("max_completion_tokens", values.get("max_tokens"))
    if wanted is not None:
        out["max_new_tokens"] = wanted
    return out


def _read_json():
    request.max_content_length = MAX_BODY_BYTES
    raw = request.get_data(cache=False)
    try:
        return json_input.loads(raw)
    except json_input.NotText as exc:
        raise RequestError("invalid_json", str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError("invalid_json", f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("invalid_json", "the request body nests too deeply") from None


# ---- routes

def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": _STARTED, "owned_by": "chat"}


@bp.get("/models")
def list_models() -> Response:
    """The models this server serves, its default first (503 until it is ready)."""
    return jsonify({"object": "list", "data": [_model_card(m) for m in _engine_ready().models()]})


@bp.get("/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    """One model by id."""
    if model_id not in _engine_ready().models():
        raise RequestError("model_not_found", f"the model '{model_id}' does not exist", 404, "model")
    return jsonify(_model_card(model_id))


@bp.post("/chat/completions")
def chat_completions() -> Response:
    """Answer a conversation, streamed as SSE chunks or as one JSON object."""
    state = app_state()
    body = _read_json()
    values = parse_request(body, state.settings, state.engine.vocab_size)
    _count_tools(body, values, state.settings)
    extra = openai_tools.plan(body)
    tool_mode = extra.get("tool_mode")
    engine = _engine_ready()
    # A model this server does not serve gets the default, as before there were several.
    model = values.get("model") if values.get("model") in engine.models() else engine.model_name
    gen = state.turns.answer(guard.address(state.settings), values["messages"], {**gen_params(values), **extra},
                             model)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    if values.get("stream"):
        include_usage = values.get("stream_options", {}).get("include_usage", False)
        return Response(_stream(gen, meta, include_usage, state.turns, tool_mode), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return _complete(gen, meta, state.turns, tool_mode, "logprobs" in extra)


def _count_tools(body: dict, values: dict, settings: Settings) -> None:
    """Tools become part of the prompt: with the messages, within CHAT_MAX_REQUEST_CHARS (413), counted
    before anything is checked or rendered."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return
    chars = sum(len(m["content"]) for m in values["messages"]) + len(json.dumps(tools, ensure_ascii=False))
    if chars > settings.max_request_chars:
        raise _too_large("tools", f"and 'messages' hold more than {settings.max_request_chars} characters in all")


def _usage(done: Done) -> dict:
    prompt, completion = done.usage.get("prompt_tokens", 0), done.usage.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(end: Done | Refused, request_id: str) -> ChatError:
    """An answer refused by the engine, or ended by shutdown or an engine error.

    An engine failure's own message may carry the backend's URL or body: the client gets a
    generic message with the request id; ``TurnService.record`` logs the details under that id.
    """
    if isinstance(end, Refused):
        return EngineError(end.message, end.code, PROTOCOL_STATUS.get(end.code, 400))
    if end.reason == "shutdown":
        return RequestError("shutdown", "the server is shutting down", 503)
    if end.notice:
        return ChatError(f"{end.notice} (request id {request_id})")
    return ChatError(f"the engine failed while generating (request id {request_id})")


def _complete(gen: Generation, meta: dict, turns: TurnService, tool_mode: str | None = None,
              logprobs: bool = False) -> Response:
    """Wait for the whole answer; one ``chat.completion`` object."""
    texts: list[str] = []
    entries: list[dict] = []
    reasoning: list[str] = []
    end: Done | Refused | None = None
    try:
        for event in gen.events():
            match event:
                case Delta(text=text):
                    texts.append(text)
                    entries += event.logprobs
                    if event.reasoning:
                        reasoning.append(event.reasoning)
                case Done() | Refused():
                    end = event
    finally:
        gen.cancel()  # a no-op once done; frees the engine if this greenlet is killed
        gen.close()
    assert end is not None  # events() ends with Done or Refused
    turns.record(end, "v1", meta["id"])
    if not isinstance(end, Done) or end.reason not in _FINISH:
        raise _failure(end, meta["id"])
    message, called = openai_tools.message("".join(texts), tool_mode, meta["id"])
    if reasoning:  # a thinking model's thinking, as vLLM, llama.cpp's server and DeepSeek's API name it
        message["reasoning_content"] = "".join(reasoning)
    return jsonify({**meta, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message,
                                 "logprobs": {"content": entries} if logprobs else None,
                                 "finish_reason": called or _FINISH[end.reason]}],
                    "usage": _usage(end)})


def _sse(data: object) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(gen: Generation, meta: dict, include_usage: bool, turns: TurnService,
            tool_mode: str | None = None) -> Iterator[str]:
    """SSE chunks as the engine makes them; leaving early (client gone) cancels the generation."""
    def chunk(delta: dict, finish: str | None = None, logprobs: object = None) -> str:
        out = {**meta, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return _sse(out)

    # A content chunk is nearly every chunk: the text spliced into the chunk's own encoding
    # (byte for byte what ``chunk`` writes) instead of building and dumping a dict each time.
    head, _, tail = chunk({"content": _MARK}).rpartition(json.dumps(_MARK))
    end: Done | Refused | None = None
    calls = openai_tools.CallStream(meta["id"]) if tool_mode else None
    try:
        yield chunk({"role": "assistant", "content": ""})
        for event in gen.events(KEEPALIVE_S):
            match event:
                case None:
                    yield ": keep-alive\n\n"
                case Delta(reasoning=reasoning) if reasoning:
                    yield chunk({"reasoning_content": reasoning})
                    if event.text or event.logprobs:  # the answer's text that came with it, in its own chunk
                        yield chunk({"content": event.text}, None,
                                    {"content": list(event.logprobs)} if event.logprobs else None)
                case Delta(text=text) if calls is not None:
                    for delta in calls.push(text):
                        yield chunk(delta)
                case Delta(text=text, logprobs=entries) if entries:
                    yield chunk({"content": text}, None, {"content": list(entries)})
                case Delta(text=text) if text:
                    yield head + encode_basestring(text) + tail
                case Done() | Refused():
                    end = event
        assert end is not None  # events() ends with Done or Refused
        turns.record(end, "v1", meta["id"])
        if isinstance(end, Done) and end.reason in _FINISH:
            for delta in calls.flush() if calls is not None else ():
                yield chunk(delta)
            yield chunk({}, "tool_calls" if calls is not None and calls.calls else _FINISH[end.reason])
            if include_usage:
                yield _sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(end)})
        else:
            yield _sse(error_body(_failure(end, meta["id"])))
        yield "data: [DONE]\n\n"
    finally:
        if end is None:
            log.info("v1 %s client closed the stream; generation cancelled", meta["id"])
            gen.cancel()
            turns.record(Done("cancelled"), "v1", meta["id"])
        gen.close()


_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               502: "server_error", 503: "server_error"}


def error_body(exc: ChatError) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": exc.message, "type": _ERROR_TYPE.get(exc.status, "invalid_request_error"),
                      "param": getattr(exc, "param", None), "code": exc.code}}
