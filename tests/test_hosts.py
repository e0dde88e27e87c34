"""DNS rebinding: a page on another site that points its own name at 127.0.0.1 gets nothing from this
server; redirects never carry the Host a request claimed (issue 33, item 3)."""
from __future__ import annotations

import http.client
import json

import pytest
from fakes import FakeEngine
from helpers import handshake_status, make_app

from chat.config import Settings
from chat.errors import ConfigError
from chat.web import hosts

REBIND = "rebind.attacker.example"


@pytest.fixture(scope="module")
def srv(app_factory):
    return app_factory()


def call(srv, method: str, path: str, host: str, body: dict | None = None, **headers):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    data = json.dumps(body).encode() if body is not None else None
    if data is not None:
        headers["Content-Type"] = "application/json"
    conn.putrequest(method, path, skip_host=True)
    conn.putheader("Host", host)
    for name, value in {**headers, "Content-Length": str(len(data or b""))}.items():
        conn.putheader(name, value)
    conn.endheaders(data)
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


REQUESTS = [
    ("GET", "/", None),
    ("GET", "/api/conversations", None),
    ("POST", "/api/conversations/import", {"title": "planted", "messages": [{"role": "user", "content": "x"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/healthz", None),
    ("GET", "/static/app.css", None),
]


@pytest.mark.parametrize("method,path,body", REQUESTS, ids=[f"{m} {p}" for m, p, _ in REQUESTS])
def test_a_rebinding_host_gets_403_everywhere(srv, method, path, body):
    own = f"127.0.0.1:{srv.port}"
    cookie = call(srv, "GET", "/", own)[1]["Set-Cookie"].split(";")[0]
    status, _, raw = call(srv, method, path, REBIND, body, Origin=f"http://{REBIND}", Cookie=cookie)
    assert status == 403, raw[:200]
    assert json.loads(raw)["error"]["code"] == "forbidden_host"
    ok, _, raw = call(srv, method, path, own, body, Origin=f"http://{own}", Cookie=cookie)
    assert ok in (200, 201), raw[:200]


def test_the_websocket_handshake_checks_the_host_too(srv):
    assert handshake_status(srv.ws_url, host=REBIND, origin=f"http://{REBIND}") == 403
    assert handshake_status(srv.ws_url, host=f"{REBIND}:{srv.port}") == 403
    assert handshake_status(srv.ws_url, host=f"localhost:{srv.port}", origin=f"http://localhost:{srv.port}") == 101
    assert handshake_status(srv.ws_url) == 101


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "localhost", "LOCALHOST:80",
                                  "app.localhost", "10.1.2.3", "localhost.", ""])
def test_addresses_and_localhost_names_are_always_allowed(host):
    assert hosts.allowed(host, hosts.names(Settings()))


@pytest.mark.parametrize("host", [REBIND, "localhost.attacker.example", "127.0.0.1.nip.io", "evil"])
def test_other_names_are_not(host):
    assert not hosts.allowed(host, hosts.names(Settings()))


def test_configured_names_bind_host_and_origins():
    settings = Settings(allowed_hosts=("chat.example.com", "*.corp.example"), bind="myhost:8000",
                        allowed_origins=("https://app.example.org",))
    allow = hosts.names(settings)
    for host in ("chat.example.com", "CHAT.example.com:443", "a.corp.example", "myhost:8000", "app.example.org"):
        assert hosts.allowed(host, allow), host
    for host in ("corp.example", "example.com", "chat.example.com.attacker.example"):
        assert not hosts.allowed(host, allow), host
    assert hosts.allowed(REBIND, hosts.names(Settings(allowed_hosts=("*",))))


def test_the_setting_is_parsed_and_checked():
    assert Settings.from_env({"CHAT_ALLOWED_HOSTS": " Chat.Example.com., *.x.org "}).allowed_hosts == (
        "chat.example.com", "*.x.org")
    with pytest.raises(ConfigError, match="CHAT_ALLOWED_HOSTS"):
        Settings.from_env({"CHAT_ALLOWED_HOSTS": "a b/c"})


def test_a_trusted_proxys_forwarded_host_is_checked():
    app = make_app(FakeEngine(), trusted_proxies=1, allowed_hosts=("chat.example.com",))
    client = app.test_client()
    assert client.get("/healthz", headers={"Host": "chat.example.com"}).status_code == 200
    assert client.get("/healthz", headers={"Host": "127.0.0.1", "X-Forwarded-Host": REBIND}).status_code == 403
    assert client.get("/healthz", headers={"Host": "127.0.0.1", "X-Forwarded-Host": "chat.example.com"}
                      ).status_code == 200


def test_redirects_never_echo_the_host(srv):
    status, headers, _ = call(srv, "GET", "/static//app.css?v=1", f"localhost:{srv.port}")
    assert 300 <= status < 400
    assert headers["Location"] == "/static/app.css?v=1"
