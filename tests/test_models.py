"""Several models: the remote backend lists its upstream's, a conversation remembers the one it
uses, `ready` and `/v1/models` list them, each request reaches the upstream under its own name."""
from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import pytest
from helpers import UPSTREAM_MODELS, WS, Upstream, conv_of, cookie_for, text_of, wait_for
from helpers import events_of as collect

from chat.config import Settings
from chat.engine import GenParams
from chat.engine.remote.client import RemoteEngine


@pytest.fixture
def upstream():
    """(base URL, handler class): the class's ``models`` can change, ``asked`` records each request's model."""
    handler = type("Handler", (Upstream,), {"models": list(UPSTREAM_MODELS), "asked": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1", handler
    server.shutdown()
    server.server_close()


def remote(url, **settings) -> RemoteEngine:
    engine = RemoteEngine(Settings(backend="openai", backend_url=url, **settings))
    assert wait_for(lambda: engine.ready, 5), engine.error
    return engine


def test_remote_engine_lists_the_upstream_models_default_first(upstream):
    url, handler = upstream
    engine = remote(url)
    assert engine.models() == UPSTREAM_MODELS
    events = collect(engine.submit([{"role": "user", "content": "hi"}], GenParams(model="qwen2.5:7b")))
    assert "I am qwen2.5:7b." in "".join(getattr(e, "text", "") for e in events)
    collect(engine.submit([{"role": "user", "content": "hi"}], GenParams()))
    assert handler.asked == ["qwen2.5:7b", "qwen2.5:0.5b"]
    engine.shutdown()


def test_the_setting_filters_the_list_and_the_default_stays(upstream):
    url, handler = upstream
    engine = remote(url, backend_model="embed-only", backend_models="qwen*, llama3.2:?b", model_name="Shown")
    assert engine.models() == ["Shown", "qwen2.5:0.5b", "llama3.2:1b", "qwen2.5:7b"]
    collect(engine.submit([{"role": "user", "content": "hi"}], GenParams(model="Shown")))
    assert handler.asked == ["embed-only"], "the default is asked for under the backend's own name"
    engine.shutdown()


def test_a_model_added_upstream_shows_up_once_the_list_is_stale(upstream):
    url, handler = upstream
    engine = remote(url)
    handler.models = UPSTREAM_MODELS + ["new-model"]
    assert "new-model" not in engine.models()
    engine._listed_at -= 3600  # as if MODELS_FRESH_S had passed
    engine.models()
    assert wait_for(lambda: "new-model" in engine.models())
    engine.shutdown()


def test_one_model_is_the_local_case(app_server):
    ws = WS(app_server.ws_url)
    try:
        assert ws.ready["model"] == "fake-model" and ws.ready["models"] == ["fake-model"]
    finally:
        ws.close()


@pytest.fixture
def front(upstream, app_factory):
    """This server, web tier only, in front of the multi-model upstream."""
    url, handler = upstream
    return app_factory(engine=remote(url), backend="openai", backend_url=url), handler


def _until(ws, rid):
    return ws.until(lambda f: f.get("id") == rid and f["type"] in ("done", "error"))


def test_a_conversation_remembers_its_model(front):
    srv, handler = front
    cookie = cookie_for(srv)
    ws = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
    try:
        assert ws.ready["models"] == UPSTREAM_MODELS
        frames = ws.chat("Who are you?", model="llama3.2:1b", params={"seed": 5})
        conv = conv_of(frames)
        assert text_of(frames) == "I am llama3.2:1b."
        stored = json.loads(_get(srv, cookie, f"/api/conversations/{conv}"))
        assert (stored["model"], stored["params"]) == ("llama3.2:1b", {"seed": 5})
        assert text_of(ws.chat("And now?", rid="r2", conversation_id=conv)) == "I am llama3.2:1b."
        ws.send({"type": "regenerate", "id": "r3", "conversation_id": conv})
        assert text_of(_until(ws, "r3")) == "I am llama3.2:1b."
        # the user picks another model for this conversation
        _patch(srv, cookie, conv, {"model": "qwen2.5:7b"})
        assert text_of(ws.chat("And after the switch?", rid="r4", conversation_id=conv)) == "I am qwen2.5:7b."
        # a model the upstream stopped serving: its default answers instead
        handler.models = ["qwen2.5:0.5b"]
        srv.state.engine._listed_at -= 3600
        srv.state.engine.models()
        assert wait_for(lambda: srv.state.engine.models() == ["qwen2.5:0.5b"])
        assert text_of(ws.chat("Still there?", rid="r5", conversation_id=conv)) == "I am qwen2.5:0.5b."
        error = ws.chat("Hi", rid="r6", model="not-served")[-1]
        assert (error["type"], error["code"]) == ("error", "bad_message") and "not-served" in error["message"]
        assert ws.ping()["type"] == "pong"
    finally:
        ws.close()
    assert handler.asked == ["llama3.2:1b"] * 3 + ["qwen2.5:7b", "qwen2.5:0.5b"]


def test_v1_lists_and_uses_the_models(front):
    srv, handler = front
    listed = json.loads(_get(srv, None, "/v1/models"))
    assert [m["id"] for m in listed["data"]] == UPSTREAM_MODELS
    assert json.loads(_get(srv, None, "/v1/models/llama3.2:1b"))["id"] == "llama3.2:1b"
    for asked, answered in (("qwen2.5:7b", "qwen2.5:7b"), ("gpt-4o", "qwen2.5:0.5b"), (None, "qwen2.5:0.5b")):
        body = {"messages": [{"role": "user", "content": "hi"}], **({"model": asked} if asked else {})}
        reply = json.loads(_post(srv, "/v1/chat/completions", body))
        assert reply["model"] == answered and reply["choices"][0]["message"]["content"] == f"I am {answered}."
    assert handler.asked == ["qwen2.5:7b", "qwen2.5:0.5b", "qwen2.5:0.5b"]


def _request(srv, method, path, cookie=None, body=None):
    import urllib.request
    req = urllib.request.Request(srv.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json", **({"Cookie": cookie} if cookie else {})})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def _get(srv, cookie, path):
    return _request(srv, "GET", path, cookie)


def _post(srv, path, body):
    return _request(srv, "POST", path, None, body)


def _patch(srv, cookie, conv, body):
    return json.loads(_request(srv, "PATCH", f"/api/conversations/{conv}", cookie, body))
