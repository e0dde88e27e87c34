"""``POST /v1/completions``: OpenAI's legacy text endpoint, which scoring tools use: a raw ``prompt``
(no chat template), ``max_tokens`` (0: only score the prompt), ``echo`` and ``logprobs`` (every
prompt token's log probability when echoed). Values come from the model's unmodified distribution.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator

from flask import Blueprint, Response, jsonify

from .. import params as sampling
from ..app_state import app_state
from ..config import Settings
from ..engine import Generation
from ..engine.events import Delta, Done, Refused
from ..errors import RequestError
from . import guard
from . import openai_api as api

if TYPE_CHECKING:
    from ..turns import TurnService

bp = Blueprint("openai_completions", __name__, url_prefix="/v1")
bp.before_request(api._authorize)
MAX_LOGPROBS = 20


def _prompt(value: Any, name: str, settings: Settings) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise api._bad(name, "must be a non-empty string (one prompt per request)")
    if len(value) > settings.max_request_chars:
        raise RequestError("too_large", f"'{name}' is longer than {settings.max_request_chars} characters",
                           413, name)
    return value


FIELDS = {
    "prompt": _prompt,
    "model": api._string,
    "temperature": api._sampling,
    "top_p": api._sampling,
    "top_k": api._sampling,
    "min_p": api._sampling,
    "max_tokens": api._integer(0),
    "seed": api._sampling,
    "stop": api._stop,
    "n": api._n,
    "stream": api._boolean,
    "echo": api._boolean,
    "logprobs": api._integer(0, MAX_LOGPROBS),
    "suffix": api._unsupported("this server does not fill in the middle"),
    "best_of": api._n,
}


def parse(body: Any, settings: Settings, vocab: int | None = None) -> dict:
    """Validate a completions body; null counts as absent, unknown fields are ignored. ``vocab``: the
    model's vocabulary when known (top_k's bound), as for chat completions."""
    if not isinstance(body, dict):
        raise RequestError("invalid_request", "the request body must be a JSON object")
    values = {k: parse(body[k], k, settings) for k, parse in FIELDS.items() if body.get(k) is not None}
    if "prompt" not in values:
        raise api._bad("prompt", "is required")
    what = sampling.check("top_k", values["top_k"], vocab=vocab) if "top_k" in values else None
    if what is not None:
        raise api._bad("top_k", f"must be {what}: the model's vocabulary")
    return values


def _params(values: dict) -> dict:
    out = {k: values[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop") if k in values}
    out["max_new_tokens"] = values.get("max_tokens", 16)  # OpenAI's default
    out["raw_prompt"] = True
    if "logprobs" in values:
        out["logprobs"] = values["logprobs"]
        if values.get("echo"):
            out["prompt_logprobs"] = values["logprobs"]
    return out


def _legacy(entries: list, offset: int) -> dict:
    """OpenAI's legacy ``logprobs`` object for a run of entries starting at text ``offset``."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({a["token"]: a["logprob"] for a in e["top_logprobs"]} if e["logprob"] is not None
                                   or e["top_logprobs"] else None)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


@bp.post("/completions")
def completions() -> Response:
    """Continue (or only score) a raw prompt."""
    state = app_state()
    values = parse(api._read_json(), state.settings, state.engine.vocab_size)
    engine = api._engine_ready()
    model = values.get("model") if values.get("model") in engine.models() else engine.model_name
    gen = state.turns.answer(guard.address(state.settings), [{"role": "user", "content": values["prompt"]}],
                             _params(values), model)
    rid = f"cmpl-{uuid.uuid4().hex}"
    meta = {"id": rid, "created": int(time.time()), "model": model,
            "object": "text_completion"}
    echo = values["prompt"] if values.get("echo") else ""
    if values.get("stream"):
        return Response(_stream(gen, meta, echo, "logprobs" in values, state.turns), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts: list[str] = []
    entries: list[dict] = []
    end: Done | Refused | None = None
    try:
        for event in gen.events():
            if isinstance(event, Delta):
                texts.append(event.text)
                entries += list(event.prompt_logprobs) + list(event.logprobs)
            elif isinstance(event, (Done, Refused)):
                end = event
    finally:
        gen.cancel()
        gen.close()
    assert end is not None
    state.turns.record(end, "v1", rid)
    if not isinstance(end, Done) or end.reason not in api._FINISH:
        raise api._failure(end, rid)
    logprobs = _legacy(entries, 0) if "logprobs" in values else None
    return jsonify({**meta, "choices": [{"index": 0, "text": echo + "".join(texts), "logprobs": logprobs,
                                         "finish_reason": api._FINISH[end.reason]}],
                    "usage": api._usage(end)})


def _stream(gen: Generation, meta: dict, echo: str, logprobs: bool, turns: TurnService) -> Iterator[str]:
    def chunk(text: str, entries: Any = (), offset: int = 0, finish: str | None = None) -> str:
        return api._sse({**meta, "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                              "logprobs": _legacy(list(entries), offset) if logprobs else None}]})

    end: Done | Refused | None = None
    offset = 0
    try:
        for event in gen.events(api.KEEPALIVE_S):
            if event is None:
                yield ": keep-alive\n\n"
            elif isinstance(event, Delta):
                text = event.text
                if event.prompt_logprobs or (echo and offset == 0):
                    text, entries = echo + text, list(event.prompt_logprobs) + list(event.logprobs)
                    echo = ""
                else:
                    entries = list(event.logprobs)
                if text or entries:
                    yield chunk(text, entries, offset)
                offset += len(text)
            elif isinstance(event, (Done, Refused)):
                end = event
        assert end is not None
        turns.record(end, "v1", meta["id"])
        if isinstance(end, Done) and end.reason in api._FINISH:
            yield chunk(echo, (), offset, api._FINISH[end.reason])
        else:
            yield api._sse(api.error_body(api._failure(end, meta["id"])))
        yield "data: [DONE]\n\n"
    finally:
        if end is None:
            gen.cancel()
            turns.record(Done("cancelled"), "v1", meta["id"])
        gen.close()
