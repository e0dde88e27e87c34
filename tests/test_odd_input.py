"""Odd input at every edge gets a 4xx or a ``bad_message`` frame, never a 500 or ``internal``, and
the connection stays usable: lone surrogates in any text, numbers out of range, cross-origin
writes, bodies that are not declared JSON. Plus the access log's redaction and the limits' atomic
steps (in this process and in Redis)."""
from __future__ import annotations

import json
import threading

import pytest
import websocket
from conftest import WS, conv_of
from redis_server import RedisServer

from chat.config import Settings
from chat.errors import ProtocolError
from chat.state import open_state
from chat.web.access_log import redact_query, redact_request_line, redact_uri

LONE = "\\ud800"  # as it arrives in JSON text
ALICE = "alice-odd-client-0123456789"


@pytest.fixture(scope="module")
def srv(app_factory):
    return app_factory(max_new_tokens=8)


def _client(srv):
    client = srv.app.test_client()
    client.set_cookie("chat_client", ALICE)
    return client


def _frame(client: WS, raw: str) -> dict:
    client.send(raw)
    return client.until(lambda f: f["type"] in ("error", "pong", "done"))[-1]


@pytest.mark.parametrize("raw", [
    '{"type": "chat", "id": "a", "content": "hi ' + LONE + '"}',
    '{"type": "chat", "id": "a", "content": "hi", "system": "' + LONE + '"}',
    '{"type": "chat", "id": "a", "content": "hi", "attachments": [{"name": "' + LONE + '.txt", "text": "x"}]}',
    '{"type": "chat", "id": "a", "content": "hi", "attachments": [{"name": "a.txt", "text": "' + LONE + '"}]}',
    '{"type": "ping", "t": "' + LONE + '"}',
    '{"type": "ping", "t": {"' + LONE + '": [1, {"x": "\\udfff"}]}}',
    '{"type": "chat", "id": "a", "content": "hi", "params": {"temperature": ' + "9" * 4000 + '}}',
    '{"type": "chat", "id": "a", "content": "hi", "params": {"top_p": 1e308}}',
])
def test_odd_frames_get_bad_message_and_the_socket_stays_usable(srv, raw):
    client = WS(srv.ws_url, cookie=f"chat_client={ALICE}")
    try:
        frame = _frame(client, raw)
        assert (frame["type"], frame["code"]) == ("error", "bad_message"), frame
        assert client.ping()["type"] == "pong"
        assert client.chat("still here", rid="ok", params={"max_new_tokens": 2})[-1]["type"] == "done"
    finally:
        client.close()


def test_a_surrogate_pair_is_text(srv):
    client = WS(srv.ws_url, cookie=f"chat_client={ALICE}")
    try:
        assert _frame(client, '{"type": "ping", "t": "\\ud83d\\ude00"}') == {"type": "pong", "t": "😀"}
    finally:
        client.close()


def _import(client, body, **kwargs):
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post("/api/conversations/import", data=data,
                       content_type=kwargs.pop("content_type", "application/json"), **kwargs)


@pytest.mark.parametrize("body", [
    '{"title": "' + LONE + '", "messages": [{"role": "user", "content": "x"}]}',
    '{"messages": [{"role": "user", "content": "x' + LONE + '"}]}',
    '{"messages": [{"role": "user", "content": "x", "created_at": ' + "1" * 4000 + '}]}',
    '{"messages": [{"role": "user", "content": "x", "created_at": 1e308}]}',
    '{"created_at": 1e308, "messages": [{"role": "user", "content": "x"}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", '
    '"usage": {"prompt_tokens": ' + "7" * 4000 + '}}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", '
    '"timings": {"total_ms": "slow"}}]}',
    '{"messages": [{"role": "user", "content": "x"}], "params": {"temperature": ' + "9" * 4000 + '}}',
])
def test_odd_imports_are_400_bad_message(srv, body):
    client = _client(srv)
    response = _import(client, body)
    assert response.status_code == 400, response.get_data()
    assert response.get_json()["error"]["code"] == "bad_message"


def test_an_import_in_range_exports_as_markdown(srv):
    client = _client(srv)
    body = {"created_at": 253402300799, "messages": [{"role": "user", "content": "x", "created_at": 0}]}
    conv = _import(client, body).get_json()["id"]
    exported = client.get(f"/api/conversations/{conv}/export?format=md")
    assert exported.status_code == 200 and b"9999-12-31" in exported.data


def test_odd_patch_and_v1_bodies_are_400(srv):
    client = _client(srv)
    conv = _import(client, {"messages": [{"role": "user", "content": "x"}]}).get_json()["id"]
    response = client.patch(f"/api/conversations/{conv}", data='{"title": "' + LONE + '"}',
                            content_type="application/json")
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "bad_message"
    for body in ('{"messages": [{"role": "user", "content": "' + LONE + '"}]}',
                 '{"messages": [{"role": "user", "content": "x"}], "temperature": ' + "9" * 4000 + '}'):
        response = client.post("/v1/chat/completions", data=body, content_type="application/json")
        assert response.status_code == 400, response.get_data()
        assert response.get_json()["error"]["type"] == "invalid_request_error"


# ---- cross-origin writes

def test_writes_need_json_and_the_pages_own_origin(srv):
    client = _client(srv)
    body = json.dumps({"messages": [{"role": "user", "content": "planted"}]})
    own = "http://localhost"  # the test client's Host
    for kwargs in ({"content_type": "text/plain"}, {"content_type": "application/x-www-form-urlencoded"},
                   {"content_type": "multipart/form-data; boundary=x"}):
        response = _import(client, body, **kwargs)
        assert response.status_code == 400 and response.get_json()["error"]["code"] == "bad_message"
    response = _import(client, body, headers={"Origin": "http://evil.example"})
    assert response.status_code == 403 and response.get_json()["error"]["code"] == "forbidden"
    assert client.get("/api/conversations").get_json() == [] or all(
        c["title"] != "planted (imported)" for c in client.get("/api/conversations").get_json())
    conv = _import(client, body, headers={"Origin": own}).get_json()["id"]  # the page itself
    for method in (client.delete, client.patch):
        response = method(f"/api/conversations/{conv}", headers={"Origin": "http://localhost:9999"},
                          data="{}", content_type="application/json")
        assert response.status_code == 403
    response = client.post("/v1/chat/completions", data='{"messages": [{"role": "user", "content": "x"}]}',
                           content_type="text/plain")
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "invalid_json"
    response = client.post("/v1/chat/completions", data='{"messages": [{"role": "user", "content": "x"}]}',
                           content_type="application/json", headers={"Origin": "http://evil.example"})
    assert response.status_code == 403
    assert client.delete(f"/api/conversations/{conv}").status_code == 200  # no body, no Origin: a program


# ---- the access log

@pytest.mark.parametrize("line, shown", [
    ("GET /ws?token=KEY HTTP/1.1", "GET /ws?token=[redacted] HTTP/1.1"),
    ("GET /ws?tok%65n=KEY HTTP/1.1", "GET /ws?tok%65n=[redacted] HTTP/1.1"),
    ("GET /ws?a=1&%74oken=KEY;TOKEN=K2 HTTP/1.1", "GET /ws?a=1&%74oken=[redacted];TOKEN=[redacted] HTTP/1.1"),
    ("GET /api/search?q=secret+words HTTP/1.1", "GET /api/search?q=[redacted] HTTP/1.1"),
    ("GET /api/%73earch?%71=secret HTTP/1.1", "GET /api/%73earch?%71=[redacted] HTTP/1.1"),
    ("GET /api/conversations?q=kept HTTP/1.1", "GET /api/conversations?q=kept HTTP/1.1"),
])
def test_access_log_redaction_decodes_before_matching(line, shown):
    assert redact_request_line(line) == shown
    assert "KEY" not in redact_uri(line.split()[1]) and "secret" not in redact_uri(line.split()[1])


def test_search_words_are_logged_only_with_log_content():
    assert redact_query("q=secret", "/api/search", log_content=True) == "q=secret"
    assert redact_query("q=secret&token=K", "/api/search", log_content=True) == "q=secret&token=[redacted]"


# ---- the limits' atomic steps

@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    yield server.url
    server.close()


@pytest.fixture(params=["local", "redis"])
def limits(request, tmp_path):
    url = ""
    if request.param == "redis":
        import redis
        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushall()
    settings = Settings(data_dir=str(tmp_path), state_url=url, max_connections_per_ip=32,
                        rate_limit_per_min=10, rate_limit_per_ip_per_min=20)
    state = open_state(settings)
    state.start(None)
    yield state.limits
    state.close()


def test_sockets_are_counted_in_one_step_with_their_check(limits):
    barrier = threading.Barrier(100)
    taken = []

    def handshake():
        barrier.wait()
        taken.append(limits.connect("198.51.100.7"))

    threads = [threading.Thread(target=handshake) for _ in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert taken.count(True) == 32 and len(taken) == 100
    assert limits.connect("203.0.113.1")
    limits.disconnect("198.51.100.7")
    assert limits.connect("198.51.100.7") and not limits.connect("198.51.100.7")


def test_imports_spend_the_client_and_address_rates(limits):
    limits.spend("198.51.100.8", "cookie-one-0123456789", 8)
    with pytest.raises(ProtocolError) as refused:
        limits.spend("198.51.100.8", "cookie-one-0123456789", 8)  # 2 left of the client's 10
    assert refused.value.code == "rate_limited"
    limits.spend("198.51.100.8", "cookie-two-0123456789", 10)  # a fresh cookie: the address has 12
    with pytest.raises(ProtocolError):
        limits.spend("198.51.100.8", "cookie-three-012345678", 8)  # fresh again: the address has 2
    limits.spend("203.0.113.8", "cookie-three-012345678", 1000)  # more than a bucket: a full one will do


def test_sockets_over_the_limit_are_refused_at_the_handshake(app_factory):
    srv = app_factory(max_connections_per_ip=3)
    open_ = [WS(srv.ws_url) for _ in range(3)]
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        WS(srv.ws_url)
    assert refused.value.status_code == 429
    open_.pop().close()
    for _ in range(100):  # the closed one gives its place back once its session ends
        try:
            open_.append(WS(srv.ws_url))
            break
        except websocket.WebSocketBadStatusException:
            threading.Event().wait(0.05)
    assert len(open_) == 3
    for client in open_:
        client.close()


def test_resumes_are_throttled_per_connection(srv):
    client = WS(srv.ws_url, cookie=f"chat_client={ALICE}")
    try:
        frames = client.chat("a finished answer", rid="fin", params={"max_new_tokens": 8})
        assert frames[-1]["type"] == "done" and conv_of(frames)
        codes = []
        for _ in range(40):
            client.send({"type": "resume", "id": "fin", "from": 0})
            last = client.until(lambda f: f.get("id") == "fin" and f["type"] in ("done", "error"))[-1]
            codes.append(last.get("code", last["type"]))
        assert codes[:16] == ["done"] * 16 and "rate_limited" in codes[16:]
        assert client.ping()["type"] == "pong"
    finally:
        client.close()
