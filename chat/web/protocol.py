"""Parse and validate client WebSocket messages into requests, or raise protocol errors."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import attachments as files
from .. import params as sampling
from ..errors import PROTOCOL_STATUS, ChatError, ProtocolError, RequestError
from . import json_input

PROTOCOL = "chat.v1"
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # always fullmatch: "$" would let a trailing newline in


@dataclass
class Request:
    """A validated client message."""

    type: str
    id: str | None = None
    content: str | None = None
    conversation_id: str | None = None
    system: str | None = None
    params: dict = field(default_factory=dict)
    message_id: str | None = None
    attachments: list = field(default_factory=list)
    model: str | None = None
    from_index: int = 0
    t: object = None
    structured: dict = field(default_factory=dict)  # grammar and tools from params (response_format, tools)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _req_id(v: Any) -> str | None:
    if not isinstance(v, str) or not ID.fullmatch(v):
        return "must be 1-64 characters of A-Z, a-z, 0-9, _ or -"
    return None


def _content(v: Any) -> str | None:
    if not isinstance(v, str) or not v.strip():
        return "must be a non-empty string"
    return None


def _conv_id(v: Any) -> str | None:
    # Malformed but string ids are left to the store, which answers not_found for them.
    if not isinstance(v, str) or len(v) > 200:
        return "must be a conversation id string"
    return None


def _message_id(v: Any) -> str | None:
    # Like conversation ids: the store answers bad_message for one that is not on the path.
    return _conv_id(v) and "must be a message id string"


def _model(v: Any) -> str | None:
    # Whether the engine serves it is the turn service's check.
    return None if isinstance(v, str) and 0 < len(v) <= 200 else "must be a model name of 1-200 characters"


def _opt_str(v: Any) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def _from(v: Any) -> str | None:
    return None if _is_int(v) and v >= 0 else "must be an integer >= 0"


def _any(v: Any) -> str | None:
    return None


def _params(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be an object"


# field -> (required, check); one row per message type.
MESSAGES: dict[str, dict[str, tuple[bool, Callable[[Any], str | None]]]] = {
    "chat": {"id": (True, _req_id), "content": (True, _content), "conversation_id": (False, _conv_id),
             "system": (False, _opt_str), "params": (False, _params), "attachments": (False, files.problem),
             "model": (False, _model)},
    "regenerate": {"id": (True, _req_id), "conversation_id": (True, _conv_id), "message_id": (False, _message_id),
                   "params": (False, _params)},
    "edit": {"id": (True, _req_id), "conversation_id": (True, _conv_id), "message_id": (True, _message_id),
             "content": (True, _content), "params": (False, _params)},
    "continue": {"id": (True, _req_id), "conversation_id": (True, _conv_id), "params": (False, _params)},
    "cancel": {"id": (True, _req_id)},
    "stop": {},
    "resume": {"id": (True, _req_id), "from": (True, _from)},
    "ping": {"t": (False, _any)},
}


def parse(raw: str | bytes, max_content_chars: int, max_new_tokens: int, vocab: int | None = None) -> Request:
    """Turn one WebSocket frame into a Request; errors follow protocol.md's precedence.
    ``vocab``: the model's vocabulary when known (top_k's bound)."""
    if isinstance(raw, (bytes, bytearray)):
        raise ProtocolError("bad_message", "binary frames are not accepted; send JSON text")
    try:
        msg = json_input.loads(raw)
    except json_input.NotText as exc:
        raise ProtocolError("bad_message", str(exc)) from None
    except (ValueError, RecursionError):
        raise ProtocolError("bad_json", "the message is not valid JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_message", "the message must be a JSON object")
    rid = msg.get("id") if isinstance(msg.get("id"), str) and ID.fullmatch(msg.get("id", "")) else None
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("bad_message", "field 'type' is required and must be a string", rid)
    spec = MESSAGES.get(kind)
    if spec is None:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}", rid)
    for name, (required, check) in spec.items():
        if name not in msg:
            if required:
                raise ProtocolError("bad_message", f"field {name!r} is required", rid)
            continue
        if msg[name] is None and not required:
            continue
        problem = check(msg[name])
        if problem:
            raise ProtocolError("bad_message", f"field {name!r} {problem}", rid)
    params = msg.get("params") or {}
    problem = sampling.problem(params, max_new_tokens, vocab=vocab)  # unknown extra fields are ignored
    if problem:
        raise ProtocolError("bad_message", problem, rid)
    structured = _structured(params, rid, kind) if "params" in spec else {}
    params = sampling.clean(params)
    attached = files.clean(msg.get("attachments")) if "attachments" in spec else []
    if isinstance(msg.get("system"), str) and len(msg["system"]) > max_content_chars:
        raise ProtocolError("too_large", f"system is longer than {max_content_chars} characters", rid)
    if isinstance(msg.get("content"), str) and len(msg["content"]) + files.chars(attached) > max_content_chars:
        what = "content plus attachments" if attached else "content"
        raise ProtocolError("too_large", f"{what} is longer than {max_content_chars} characters", rid)
    return Request(type=kind, id=msg.get("id"), content=msg.get("content"),
                   conversation_id=msg.get("conversation_id"), system=msg.get("system"),
                   params=params, message_id=msg.get("message_id"), attachments=attached,
                   model=msg.get("model") if "model" in spec else None,
                   from_index=msg.get("from", 0), t=msg.get("t"), structured=structured)


STRUCTURED = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs")


def _structured(params: dict, rid: str | None, kind: str) -> dict:
    """The engine parameters of ``params``' structured fields (as on /v1: openai_tools.plan)."""
    wanted = {k: params[k] for k in STRUCTURED if params.get(k) is not None}
    if not wanted:
        return {}
    grammar = [k for k in wanted if k in STRUCTURED[:4]]
    if kind == "continue" and grammar:  # a grammar would start over in the middle of the answer
        raise ProtocolError("bad_message", f"params: {', '.join(grammar)} cannot be used to continue an answer", rid)
    from .openai_tools import plan
    try:
        out = plan(wanted)
    except RequestError as exc:
        raise ProtocolError("bad_message", f"params: {exc.message}", rid) from None
    return out


def error_frame(exc: ChatError, id: str | None = None) -> dict:
    """The ``error`` frame for any error; codes outside the protocol's become ``internal``."""
    code = exc.code if exc.code in PROTOCOL_STATUS else "internal"
    frame = {"type": "error", "code": code, "message": exc.message}
    id = getattr(exc, "id", None) or id
    if id is not None:
        frame["id"] = id
    return frame
