"""The turn service through the socket: the key known at submit, cheap refusals first, no orphans."""
from __future__ import annotations

import json
import sqlite3

import pytest
from fakes import FakeEngine
from helpers import WS, conv_of, cookie_for, http_get

NOWHERE = "0123456789abcdef0123456789abcdef"


def test_the_engine_gets_the_conversation_key_at_submit(app_factory):
    engine = FakeEngine()
    client = WS(app_factory(engine).ws_url)
    frames = client.chat("hi", params={"max_new_tokens": 3})
    assert engine.history[-1].key == conv_of(frames)
    follow = client.chat("again", rid="r2", conversation_id=conv_of(frames), params={"max_new_tokens": 3})
    assert engine.history[-1].key == conv_of(follow) == conv_of(frames)
    assert engine.history[-1].messages[0] == {"role": "system", "content": "You are a helpful assistant."}
    client.close()


def test_refused_requests_spend_no_rate_token(app_factory):
    client = WS(app_factory(FakeEngine(), rate_limit_per_min=1).ws_url)
    assert client.chat("hi", rid="a", conversation_id=NOWHERE)[-1]["code"] == "not_found"
    assert client.chat("hi", rid="b", params={"max_new_tokens": 2})[-1]["type"] == "done"
    assert client.chat("hi", rid="c")[-1]["code"] == "rate_limited"
    client.close()


def test_a_store_failure_cancels_the_generation(app_factory, monkeypatch):
    engine = FakeEngine(answer_words=100_000, delay=0.001)
    srv = app_factory(engine)

    def broken(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(srv.state.store, "add_user_message", broken)
    cookie = cookie_for(srv)
    client = WS(srv.ws_url, cookie=cookie)
    error = client.chat("hi", rid="lost")[-1]
    assert (error["type"], error["code"], error["id"]) == ("error", "internal", "lost")
    assert engine.history[-1].cancel_reason == "error"  # not left running with nobody to read it
    assert not srv.state.turns.runs.all_active()
    listed = json.loads(http_get(srv.url + "/api/conversations", headers={"Cookie": cookie})[2])
    assert listed == []  # the refused first message left no empty "New chat"
    monkeypatch.undo()
    assert client.chat("hi", rid="lost", params={"max_new_tokens": 2})[-1]["type"] == "done"
    client.close()


@pytest.mark.parametrize("before, usage, timings, whole", [
    # two parts of 10 tokens at 10 and 20 tokens/s: 20 tokens in 1.5 s
    ({"usage": {"prompt_tokens": 30, "completion_tokens": 10},
      "timings": {"ttft_ms": 50.0, "total_ms": 1000.0, "tokens_per_s": 10.0}},
     {"prompt_tokens": 45, "completion_tokens": 10}, {"ttft_ms": 20.0, "total_ms": 500.0, "tokens_per_s": 20.0},
     ({"prompt_tokens": 30, "completion_tokens": 20}, {"ttft_ms": 50.0, "total_ms": 1500.0, "tokens_per_s": 13.3})),
    # an answer stopped before any figures (interrupted): the new part's own
    ({"usage": None, "timings": None}, {"prompt_tokens": 45, "completion_tokens": 10},
     {"ttft_ms": 20.0, "total_ms": 500.0, "tokens_per_s": 20.0},
     ({"prompt_tokens": 45, "completion_tokens": 10}, {"ttft_ms": 20.0, "total_ms": 500.0, "tokens_per_s": 20.0})),
])
def test_a_continued_answers_figures_cover_the_whole_answer(before, usage, timings, whole):
    from chat.runs import whole_answer
    assert whole_answer(before, usage, timings) == whole
