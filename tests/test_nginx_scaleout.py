"""deploy/nginx-scaleout.conf on a real nginx in front of two app instances: round robin without
stickiness, WebSockets, failover for what may be retried and never for a completion."""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from pathlib import Path

import pytest
from fakes import FakeEngine
from helpers import WS, free_port, text_of
from services import Nginx, render_site, start_nginx

ROOT = Path(__file__).resolve().parent.parent
SCALEOUT = ROOT / "deploy" / "nginx-scaleout.conf"
SINGLE = ROOT / "deploy" / "nginx.conf"
COMPLETION = json.dumps({"model": "any", "stream": True, "max_tokens": 5,
                         "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def hosts(app_factory):
    """Two app instances, told apart by their model name (in /readyz and the ``ready`` frame)."""
    apps = []
    for name in ("host-a", "host-b"):
        engine = FakeEngine(answer_words=5, delay=0.001)
        engine.model_name = name
        apps.append(app_factory(engine=engine))
    return apps


@pytest.fixture
def proxy(hosts, tmp_path):
    nginx = Nginx(tmp_path, SCALEOUT, [app.port for app in hosts])
    yield nginx
    nginx.stop()


def request(port: int, method: str, path: str, body=None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def served_by(port: int) -> str:
    """Which host answered a GET /readyz through nginx."""
    status, body = request(port, "GET", "/readyz")
    assert status == 200, body
    return json.loads(body)["model"]


def directives(conf: Path, location: str) -> set[str]:
    """The directives of one ``location`` block, comments dropped."""
    text = re.sub(r"#[^\n]*", "", conf.read_text())
    block = re.search(re.escape(f"location {location}") + r"\s*\{(.*?)\}", text, re.S)
    assert block, f"{conf.name} has no location {location}"
    return {" ".join(d.split()) for d in block.group(1).split(";") if d.strip()}


def test_no_stickiness_in_the_config():
    text = re.sub(r"#[^\n]*", "", SCALEOUT.read_text())
    upstream = re.search(r"upstream chat \{(.*?)\}", text, re.S).group(1)
    assert not re.search(r"\b(ip_hash|hash|sticky)\b", upstream)
    servers = re.findall(r"server\s+(\S+)\s+([^;]*);", upstream)
    assert len(servers) >= 2 and all("max_fails=" in p and "fail_timeout=" in p for _, p in servers)
    assert "non_idempotent" not in text  # a completion reaches one host, once


@pytest.mark.parametrize("location", ["= /ws", "= /v1/chat/completions"])
def test_streams_are_proxied_like_the_single_host_site(location):
    # deploy/nginx.conf's streaming settings are tested live in test_nginx.py: keep them all here.
    assert directives(SINGLE, location) <= directives(SCALEOUT, location)


def test_render_keeps_the_server_parameters():
    site = render_site(SCALEOUT, [8101, "127.0.0.1:8102"], 9000)
    assert "server 127.0.0.1:8101 max_fails=3 fail_timeout=10s;" in site
    assert "server 127.0.0.1:8102 max_fails=3 fail_timeout=10s;" in site
    assert "server web1" not in site and "server web2" not in site and "listen 127.0.0.1:9000;" in site


def test_requests_alternate_between_hosts(proxy):
    seen = [served_by(proxy.port) for _ in range(6)]
    assert sorted(set(seen)) == ["host-a", "host-b"]
    assert all(a != b for a, b in zip(seen, seen[1:])), seen  # round robin: never twice the same in a row


def test_websockets_upgrade_and_spread(proxy):
    clients = [WS(proxy.ws_url) for _ in range(2)]
    try:
        assert {c.ready["model"] for c in clients} == {"host-a", "host-b"}
        for client in clients:
            frames = client.chat("hello")
            assert frames[-1]["type"] == "done" and text_of(frames) == "w0 w1 w2 w3 w4 "
    finally:
        for client in clients:
            client.close()


def test_static_files_come_from_the_checkout(proxy):
    response = proxy.request("GET", "/static/app.css")
    assert response.status == 200 and response.read() == (ROOT / "static" / "app.css").read_bytes()
    assert response.getheader("Cache-Control") == "public, max-age=3600"


def test_metrics_are_not_proxied(proxy):
    assert proxy.request("GET", "/metrics").status == 403  # scrape each host directly


def test_a_down_host_is_skipped(hosts, tmp_path):
    port, stop = start_nginx(SCALEOUT, [free_port(), hosts[0].port], tmp_path)
    try:
        assert [served_by(port) for _ in range(4)] == ["host-a"] * 4
        status, body = request(port, "POST", "/v1/chat/completions", COMPLETION)
        assert status == 200 and b"data: [DONE]" in body  # a refused connection: safe to try the next
    finally:
        stop()


class Swallower:
    """An upstream that reads each request and hangs up without answering, recording its method."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.methods: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data:
                    self.methods.append(data.split(b" ", 1)[0].decode())

    def close(self):
        self.sock.close()


@pytest.fixture
def dropping(hosts, tmp_path):
    """(nginx port, the dropper) with the dropper first: a fresh round robin starts there."""
    dropper = Swallower()
    port, stop = start_nginx(SCALEOUT, [dropper.port, hosts[1].port], tmp_path)
    yield port, dropper
    stop()
    dropper.close()


def test_a_get_a_host_dropped_is_retried_on_the_next(dropping):
    port, dropper = dropping
    assert served_by(port) == "host-b"
    assert dropper.methods == ["GET"]


def test_a_completion_a_host_dropped_is_never_sent_again(dropping, hosts):
    port, dropper = dropping
    engine = hosts[1].state.engine
    before = len(engine.history)
    assert request(port, "POST", "/v1/chat/completions", COMPLETION)[0] == 502
    assert dropper.methods == ["POST"] and len(engine.history) == before  # it reached one host, once
    status, body = request(port, "POST", "/v1/chat/completions", COMPLETION)
    assert status == 200 and b"data: [DONE]" in body and len(engine.history) == before + 1
