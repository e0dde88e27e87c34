"""KV sharing by identity (issue 45): one client's conversation KV is reused for that client alone, so
another client cannot confirm its words by timing a first token (the attack reused 593 tokens of a
stranger's message, 33 ms against 2 s). Across clients only the operator's system prompt's preamble is
shared, or everything with CHAT_SHARED_PREFIX=all; the disk cache asks for the same identity."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from fakes import AppServer
from helpers import WS, collect, make_app, make_engine

from chat.engine import GenParams
from chat.engine.core import prompt
from chat.engine.kv import disk as kvdisk

SECRET = ("Account holder: Alice Zebulon. PIN: 7342. " + "The quarterly figures follow in full detail. " * 40).strip()
SYSTEM = "You are a helpful assistant."  # the operator's (the default CHAT_SYSTEM_PROMPT): public
OWN = "You keep a ledger for Alice."  # a system prompt a client chose


def _msgs(text: str, system: str = SYSTEM) -> list:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def _answer(engine, messages, salt, key=None):
    _, events = collect(engine.submit(messages, GenParams(temperature=0, max_new_tokens=2, cache_salt=salt), key=key))
    return events[-1]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("kvid"), kv_disk_mb=0)
    yield eng
    eng.shutdown()


def test_another_identity_reuses_none_of_a_conversations_kv(engine):
    first = _answer(engine, _msgs(SECRET), "alice", key="conv-a")
    assert first.reason == "length"
    stranger = _answer(engine, _msgs(SECRET), "mallory")  # the same text, guessed right
    own = _answer(engine, _msgs(SECRET), "alice", key="conv-a2")  # the same client, a new conversation
    preamble = len(prompt.preamble(engine.loaded.tokenizer, _msgs(SECRET)))
    assert stranger.reused_tokens <= preamble  # at most the public preamble
    assert own.reused_tokens > 300  # the client's own text still serves it


def test_a_clients_own_system_prompt_preamble_is_its_own(engine):
    _answer(engine, _msgs("hello", OWN), "alice", key="conv-b")
    _answer(engine, _msgs("hello", OWN), "alice", key="conv-b2")  # held by now (prefilled while idle)
    stranger = _answer(engine, _msgs("something else entirely", OWN), "mallory")
    assert stranger.reused_tokens == 0


def test_shared_prefix_all_shares_as_before(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path, kv_disk_mb=0, shared_prefix="all")
    try:
        _answer(eng, _msgs(SECRET), "alice", key="conv-a")
        assert _answer(eng, _msgs(SECRET), "mallory").reused_tokens > 300
    finally:
        eng.shutdown()


def test_the_disk_cache_reads_an_entry_only_for_its_identity(tmp_path):
    disk = kvdisk.DiskKV(tmp_path / "kv", 10**9, (2, 1, 16), torch.bfloat16)
    kv = [torch.zeros(1, 1, 4, 16).bfloat16()] * 2
    disk.save("conv", list(range(4)), kv, kv, "alice")
    disk.flush()
    assert disk.load("conv", "mallory") is None and disk.path("conv").exists()  # kept for its owner
    assert disk.load("conv", None) is None
    assert disk.load("conv", "alice")[0] == list(range(4))


def test_over_the_app_a_v1_caller_reuses_nothing_of_a_websocket_clients_message(engine, caplog):
    server = AppServer(make_app(engine, max_new_tokens=64))
    try:
        alice = WS(server.ws_url, cookie="chat_client=alice-kv-identity-0123456789")
        assert alice.chat(SECRET, params={"temperature": 0, "max_new_tokens": 2})[-1]["type"] == "done"
        alice.close()
        with caplog.at_level(logging.INFO, logger="chat.turns"):
            client = server.app.test_client()
            resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": SECRET}],
                                                              "temperature": 0, "max_tokens": 1})
            assert resp.status_code == 200
        lines = [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records
                 if r.getMessage().startswith("generation ") and '"v1"' in r.getMessage()]
        preamble = len(prompt.preamble(engine.loaded.tokenizer, _msgs(SECRET)))
        assert lines and lines[-1]["reused_tokens"] <= preamble
    finally:
        server.close()


def test_a_web_tier_passes_each_clients_salt_to_an_engine_that_keeps_kv_by_it(app_factory):
    """Scale-out: web hosts in front of this server's engine (or vLLM) send each client's salt as
    ``cache_salt``, so the engine shares KV by identity as one process does; a /v1 caller's own salt
    never names one of the engine's namespaces."""
    from fakes import FakeEngine
    from helpers import wait_for

    from chat.config import Settings
    from chat.engine.remote.client import RemoteEngine

    upstream_engine = FakeEngine()
    upstream = app_factory(upstream_engine, max_new_tokens=16)
    remote = RemoteEngine(Settings(backend="openai", backend_url=f"{upstream.url}/v1"))
    try:
        assert wait_for(lambda: remote.ready, timeout=10) and remote.salted
        collect(remote.submit(_msgs("hi"), GenParams(max_new_tokens=2, cache_salt="a" * 32)))
        assert upstream_engine.history[-1].params.cache_salt == "salt:" + "a" * 32
        client = upstream.app.test_client()
        assert client.post("/v1/chat/completions", json={"messages": _msgs("hi"), "max_tokens": 2}).status_code == 200
        assert upstream_engine.history[-1].params.cache_salt == "v1"
        assert client.post("/v1/chat/completions", json={"messages": _msgs("hi"), "cache_salt": ""}).status_code == 400
    finally:
        remote.shutdown()
