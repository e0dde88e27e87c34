"""CHAT_ENGINE_ONLY: a process that serves only /v1 and health to web workers, stores nothing,
and leaves per-address limits to the web tier; and the startup advice for several workers."""
from __future__ import annotations

import json
import runpy
import urllib.request
from pathlib import Path

import pytest
from fakes import FakeEngine
from helpers import ROOT, WS, conv_of, cookie_for, http_get, in_threads, text_of, wait_settled

from chat.config import Settings
from chat.engine import Generation, GenParams
from chat.engine.events import Started
from chat.errors import ProtocolError
from chat.state.local_limits import LocalLimits as Limits

# Per-address limits low enough that 20 requests from one address would hit every one of them.
TIGHT = {"max_active_per_ip": 2, "rate_limit_per_ip_per_min": 5, "rate_limit_per_min": 0, "max_batch": 4}
WEB_A, WEB_B = "10.0.0.11", "10.0.0.12"


@pytest.fixture
def serve(app_factory):
    """An in-process app (fake engine: 5 words) with these settings."""
    return lambda engine=None, **settings: app_factory(engine or FakeEngine(answer_words=5), **settings)


def post(url: str, body: dict, headers=None):
    """(status, headers, body bytes) of a JSON POST, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def completion(srv, stream=False, headers=None):
    return post(srv.url + "/v1/chat/completions", {"model": "fake-model", "stream": stream,
                                                     "messages": [{"role": "user", "content": "hi"}]}, headers)


def test_serves_v1_and_health(serve):
    srv = serve(engine_only=True)
    status, _, body = http_get(srv.url + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["fake-model"]
    status, headers, body = completion(srv)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 "
    assert headers["X-Content-Type-Options"] == "nosniff"  # the app-wide hardening headers stay
    status, headers, body = completion(srv, stream=True)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert body.decode().rstrip().endswith("data: [DONE]")
    for path in ("/healthz", "/readyz", "/metrics"):
        assert http_get(srv.url + path)[0] == 200, path


@pytest.mark.parametrize("path", ["/ws", "/api/conversations", "/api/search?q=x", "/api/conversations/x/export"])
def test_no_page_socket_or_conversations(serve, path):
    srv = serve(engine_only=True)
    status, headers, body = http_get(srv.url + path)
    assert status == 404 and headers["Content-Type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "not_found"


def test_no_page_and_no_import(serve):
    srv = serve(engine_only=True)
    assert http_get(srv.url + "/")[0] == 404
    status, _, body = post(srv.url + "/api/conversations/import", {"title": "x", "messages": []})
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_opens_no_database(serve):
    srv = serve(engine_only=True)
    assert srv.state.store is None
    assert completion(srv)[0] == 200
    assert not list(Path(srv.state.settings.data_dir).rglob("*.db*"))


def test_the_api_key_still_guards_v1(serve):
    srv = serve(engine_only=True, api_key="k3y")
    assert completion(srv)[0] == 401
    assert http_get(srv.url + "/v1/models")[0] == 401
    assert completion(srv, headers={"Authorization": "Bearer k3y"})[0] == 200
    assert http_get(srv.url + "/healthz")[0] == 200


def _twenty_at_once(srv) -> list[int]:
    statuses = [None] * 20
    def one(i):
        statuses[i] = completion(srv)[0]
    in_threads(one, 20)
    return statuses


@pytest.mark.parametrize("engine_only", [True, False])
def test_per_address_limits_only_outside_engine_only(serve, engine_only):
    # Every request comes from 127.0.0.1, like a web host's; answers overlap (8 slots, 50 ms words).
    srv = serve(FakeEngine(answer_words=5, delay=0.05, slots=8, max_queue=100), engine_only=engine_only, **TIGHT)
    statuses = _twenty_at_once(srv)
    if engine_only:
        assert statuses == [200] * 20
    else:  # the same settings on a web process do refuse them (busy: 409, rate limited: 429)
        assert sum(s in (409, 429) for s in statuses) >= 10


def test_the_engine_queue_still_refuses(serve):
    srv = serve(FakeEngine(answer_words=20, delay=0.05, slots=2, max_queue=2), engine_only=True, **TIGHT)
    statuses = _twenty_at_once(srv)
    assert statuses.count(200) >= 4 and statuses.count(503) >= 1
    assert set(statuses) <= {200, 503}


def test_no_fair_share_between_web_hosts():
    reg = Limits(Settings(engine_only=True, **TIGHT))
    gens = []
    for _ in range(6):  # one web host's users fill the batch and queue past their "share"
        gen = Generation(messages=[], params=GenParams())
        reg.track(reg.admit(WEB_A), gen)
        gens.append(gen)
    reg.admit(WEB_B)  # the other host's request waits in the queue
    for gen in gens[:4]:
        gen.emit(Started())
    reg.admit(WEB_A)  # a web process would refuse this as "overloaded" (see test_limits)
    web = Limits(Settings(**{**TIGHT, "max_active_per_ip": 0, "rate_limit_per_ip_per_min": 0}))
    for _ in range(4):
        web.track(web.admit(WEB_A), Generation(messages=[], params=GenParams()))
    web.admit(WEB_B)
    with pytest.raises(ProtocolError):
        web.admit(WEB_A)


# ---- the topology, live: a web server whose backend is an engine-only server

def test_a_web_server_streams_from_an_engine_only_server(server_factory):
    engine = server_factory("engine", CHAT_ENGINE_ONLY=1, CHAT_API_KEY="engine-key")
    assert not (engine.workdir / "data" / "chat.db").exists()
    assert http_get(engine.url + "/")[0] == 404
    web = server_factory("web", CHAT_BACKEND="openai", CHAT_BACKEND_URL=engine.url + "/v1",
                         CHAT_BACKEND_API_KEY="engine-key")
    cookie = cookie_for(web)
    client = WS(web.ws_url, cookie=cookie)
    try:
        assert client.ready["model"] == json.loads(http_get(engine.url + "/readyz")[2])["model"]
        frames = client.chat("Tell me a story.", params={"max_new_tokens": 24, "temperature": 0})
    finally:
        client.close()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] in ("stop", "length"), frames[-1]
    answer = text_of(frames)
    assert sum(f["type"] == "delta" for f in frames) >= 2 and answer
    stored = wait_settled(web, cookie, conv_of(frames))
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][-1]["content"] == answer and stored["messages"][-1]["status"] == "complete"
    assert "/v1/chat/completions" in engine.log()  # it really went through the engine


# ---- startup advice (gunicorn.conf.py's on_starting)

class _Log:
    def __init__(self):
        self.lines = []

    def warning(self, line, *args):
        self.lines.append(line % args if args else line)


def _startup_warnings(monkeypatch, **env) -> list[str]:
    for name in ("CHAT_WORKERS", "CHAT_BACKEND", "CHAT_BACKEND_URL", "CHAT_ENGINE_ONLY", "CHAT_STATE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # gunicorn.conf.py gives several workers a metrics folder through the environment: undone after
    # the test, so the servers later tests start stay single-process in their metrics
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    server = type("Server", (), {"log": _Log()})()
    conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    conf["on_starting"](server)
    conf["on_exit"](server)
    return server.log.lines


def test_one_worker_says_nothing(monkeypatch):
    assert _startup_warnings(monkeypatch) == []


def test_several_local_workers_are_told_about_model_copies_and_state(monkeypatch):
    copies, state = _startup_warnings(monkeypatch, CHAT_WORKERS="3")
    assert "3 copies" in copies and "CHAT_ENGINE_ONLY" in copies and "CHAT_BACKEND=openai" in copies
    assert "per worker" in state and "CHAT_STATE_URL" in state and "sticky" in state


def test_several_remote_workers_hear_only_about_state(monkeypatch):
    lines = _startup_warnings(monkeypatch, CHAT_WORKERS="4", CHAT_BACKEND="openai",
                              CHAT_BACKEND_URL="http://engine:8001/v1")
    assert len(lines) == 1 and "CHAT_STATE_URL" in lines[0]
