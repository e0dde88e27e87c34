"""Structured answers never end clean and wrong (issue 45): a schema no answer can satisfy is refused
with 400 when its grammar is compiled (before anything is queued), and a grammar that fails mid-answer
ends that answer with ``error``, a message and a log line, never ``stop`` with invalid JSON."""
from __future__ import annotations

import json
import logging

import pytest

from chat import structured
from chat.engine import GenParams
from helpers import WS, ask, collect, make_app, make_engine
from fakes import AppServer

CYCLIC = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
ENDLESS = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
# a first key the model can write, then a member that can never end: the grammar fails after a few tokens
LATE = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"$ref": "#/$defs/inf"}},
        "$defs": {"inf": {"type": "object", "properties": {"x": {"$ref": "#/$defs/inf"}}, "required": ["x"],
                          "additionalProperties": False}}}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("structfail"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    return make_app(engine, max_new_tokens=64).test_client()


@pytest.mark.parametrize("schema", [CYCLIC, ENDLESS], ids=["cyclic-ref", "required-recursion"])
def test_a_schema_that_allows_no_answer_is_refused_with_400(client, schema):
    resp = client.post("/v1/chat/completions", json={"messages": ask("hi"), "response_format": _format(schema),
                                                      "temperature": 0, "max_tokens": 20})
    assert resp.status_code == 400, resp.get_json()
    assert "allows no answer" in resp.get_json()["error"]["message"]


def test_a_grammar_that_fails_mid_answer_ends_with_error_and_a_log_line(engine, caplog):
    grammar = structured.schema_grammar(LATE)
    with caplog.at_level(logging.WARNING, logger="chat.engine.core.local"):
        text, events = collect(engine.submit(ask("hi"), GenParams(temperature=0, max_new_tokens=40, grammar=grammar)))
    done = events[-1]
    assert done.reason == "error" and "format could not be kept" in done.message
    assert "\n" not in done.message  # the first line of llguidance's error, not its state dump
    assert any("ended with error" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        json.loads(text)  # what was sent is a prefix, and the answer says it failed


def test_v1_reports_the_failure_instead_of_a_clean_stop(client):
    body = {"messages": ask("hi"), "response_format": _format(LATE), "temperature": 0, "max_tokens": 40}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 500 and "format could not be kept" in resp.get_json()["error"]["message"]
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True}).get_data(as_text=True)
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "format could not be kept" in chunks[-1]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1] if c.get("choices"))


def test_the_websocket_done_frame_says_error(engine):
    server = AppServer(make_app(engine, max_new_tokens=64))
    try:
        client = WS(server.ws_url)
        frames = client.chat("hi", params={"temperature": 0, "max_new_tokens": 40,
                                           "response_format": _format(LATE)})
        client.close()
    finally:
        server.close()
    done = frames[-1]
    assert done["type"] == "done" and done["reason"] == "error" and "format could not be kept" in done["message"]
