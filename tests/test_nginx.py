"""deploy/nginx.conf in front of the real gunicorn server: streams stay streams, static files are cached."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from services import Nginx

from chat.client import Session

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "deploy" / "nginx.conf"


@pytest.fixture
def nginx(server, tmp_path):
    """nginx on a free port, proxying to the live gunicorn server."""
    proxy = Nginx(tmp_path, SITE, [urlsplit(server.url).netloc])
    yield proxy
    proxy.stop()


def test_config_renders_and_passes_nginx_t(tmp_path):
    Nginx(tmp_path, SITE, ["127.0.0.1:9"]).stop()


def test_hsts_is_offered_for_the_https_block_only():
    lines = [line.strip() for line in SITE.read_text().splitlines()
             if "Strict-Transport-Security" in line]
    assert lines and all(line.startswith("#") for line in lines)  # never sent over plain http


def test_http_is_proxied(nginx):
    response = nginx.request("GET", "/healthz")
    assert response.status == 200
    assert json.loads(response.read())["status"] == "ok"
    page = nginx.request("GET", "/")
    assert page.status == 200 and "chat_client=" in page.getheader("Set-Cookie", "")
    assert nginx.request("GET", "/metrics").status == 200  # allowed from 127.0.0.1 only


def test_static_files_come_from_disk_with_caching_headers(nginx):
    response = nginx.request("GET", "/static/app.css")
    body = response.read()
    assert response.status == 200
    assert body == (ROOT / "static" / "app.css").read_bytes()
    assert response.getheader("Cache-Control") == "public, max-age=3600"
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    assert response.getheader("ETag") and response.getheader("Last-Modified")
    assert response.getheader("Content-Type", "").startswith("text/css")
    etag = response.getheader("ETag")
    again = nginx.request("GET", "/static/app.css", headers={"If-None-Match": etag})
    assert again.status == 304
    assert nginx.request("GET", "/static/no-such-file.css").status == 404


def test_a_browser_origin_through_nginx_is_accepted(nginx):
    import websocket
    # Host must reach the app with its port, or the page's own Origin looks foreign (403).
    ws = websocket.create_connection(nginx.ws_url, origin=nginx.url, timeout=10)
    try:
        assert json.loads(ws.recv())["type"] == "ready"
    finally:
        ws.close()
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(nginx.ws_url, origin="http://evil.example", timeout=10)
    assert refused.value.status_code == 403


def _timed_frames(session: Session, prompt: str, **kwargs):
    """(arrival time, frame) for every frame of one chat."""
    start = time.monotonic()
    return [(time.monotonic() - start, f) for f in session.chat(prompt, **kwargs)]


def assert_incremental(times: list[float], total: float, what: str) -> None:
    """The first piece arrived long before the last, i.e. nothing sat in a buffer."""
    assert len(times) >= 10, f"too few {what} to judge streaming: {len(times)}"
    assert times[0] < 0.5 * total, (
        f"first {what} at {times[0]:.3f} s of {total:.3f} s: the stream was buffered")
    # Pieces spread over the answer, not one burst at the end.
    assert len({round(t, 3) for t in times}) > 3


def test_websocket_deltas_stream_through_nginx(nginx, server):
    with Session(nginx.ws_url, timeout=30) as session:
        assert session.ready["protocol"] == "chat.v1"
        frames = _timed_frames(session, "Tell me a long story.",
                               params={"max_new_tokens": 64, "temperature": 0})
    deltas = [(t, f) for t, f in frames if f["type"] == "delta"]
    done_at, done = frames[-1]
    assert done["type"] == "done" and done["reason"] in ("stop", "length")
    assert [f["index"] for _, f in deltas] == list(range(len(deltas)))
    assert_incremental([t for t, _ in deltas], done_at, "delta")


def test_websocket_cancel_through_nginx(nginx):
    with Session(nginx.ws_url, timeout=30) as session:
        cancel = threading.Event()
        frames = []
        for frame in session.chat("Count to a thousand.", params={"max_new_tokens": 2000}, cancel=cancel):
            frames.append(frame)
            if frame["type"] == "delta":
                cancel.set()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "cancelled"


def test_sse_chunks_stream_through_nginx(nginx):
    body = json.dumps({"model": "any", "stream": True, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]})
    start = time.monotonic()
    # Real clients (browsers, the OpenAI SDK) accept gzip, and gzip would hold events back.
    response = nginx.request("POST", "/v1/chat/completions", body=body,
                             headers={"Content-Type": "application/json", "Accept-Encoding": "gzip, deflate"})
    assert response.status == 200
    assert response.getheader("Content-Type", "").startswith("text/event-stream")
    assert response.getheader("Content-Encoding") is None
    times, chunks = [], []
    while True:
        line = response.readline()
        assert line, "the stream ended without data: [DONE]"
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            total = time.monotonic() - start
            break
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            times.append(time.monotonic() - start)
            chunks.append(chunk)
    assert_incremental(times, total, "SSE chunk")


def test_a_document_larger_than_a_message_body_reaches_the_server(nginx):
    """deploy/nginx.conf lets /api/documents bodies past the 2m of other requests (CHAT_MAX_DOCUMENT_MB)."""
    body = b"name,notes\n" + b"x,yyyy\n" * (3 * 2**20 // 7)
    response = nginx.request("POST", "/api/documents?name=big.csv", body,
                             {"Content-Type": "application/octet-stream"})
    payload = json.loads(response.read())  # the app's JSON, never nginx's own 413 page
    assert (response.status == 200 and payload["truncated"]) or payload["error"]["code"] == "rate_limited", payload
