"""The remote backend's edges: an answer's byte budget, and top_k / min_p reaching the upstream
(issue 33, item 4)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import events_of, wait_for

from chat.config import Settings
from chat.engine import Delta, GenParams
from chat.engine.remote.client import BYTES_PER_TOKEN, MIN_ANSWER_BYTES, RemoteEngine

HELLO = [{"role": "user", "content": "hi"}]


class Flood(BaseHTTPRequestHandler):
    """An upstream that ignores max_tokens: ``chunks`` deltas of ``piece``, and records what it was asked."""

    protocol_version = "HTTP/1.0"
    piece = "x" * 1000
    chunks = 10_000
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "flood"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        line = f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': self.piece}}]})}\n\n".encode()
        try:
            for _ in range(self.chunks):
                self.wfile.write(line)
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass  # the client hung up: what this test wants


@pytest.fixture
def flood():
    servers = []

    def start(**attrs):
        handler = type("Handler", (Flood,), {"bodies": [], **attrs})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        engine = RemoteEngine(Settings(backend="openai", backend_url=f"http://127.0.0.1:{server.server_port}/v1"))
        wait_for(lambda: engine.ready or engine.error)
        return engine, handler
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_an_upstream_that_ignores_max_tokens_is_cut_at_the_byte_budget(flood):
    engine, _ = flood()
    try:
        events = events_of(engine.submit(HELLO, GenParams(max_new_tokens=100)), 60)
        text = "".join(e.text for e in events if isinstance(e, Delta))
        assert len(text.encode()) == MIN_ANSWER_BYTES  # 10 MB offered
        assert events[-1].reason == "length"
        events = events_of(engine.submit(HELLO, GenParams(max_new_tokens=4000)), 60)
        assert len("".join(e.text for e in events if isinstance(e, Delta)).encode()) == BYTES_PER_TOKEN * 4000
    finally:
        engine.shutdown()


def test_a_cut_never_splits_a_character(flood):
    engine, _ = flood(piece="é" * 333)  # 666 bytes a delta: the budget falls inside a character
    try:
        events = events_of(engine.submit(HELLO, GenParams(max_new_tokens=1)), 60)
        text = "".join(e.text for e in events if isinstance(e, Delta))
        assert set(text) == {"é"} and len(text.encode()) in (MIN_ANSWER_BYTES, MIN_ANSWER_BYTES - 1)
    finally:
        engine.shutdown()


def test_top_k_and_min_p_reach_the_upstream(flood):
    engine, handler = flood(chunks=1)
    try:
        events_of(engine.submit(HELLO, GenParams(top_k=40, min_p=0.05, max_new_tokens=5)), 60)
        events_of(engine.submit(HELLO, GenParams(max_new_tokens=5)), 60)
        asked, plain = handler.bodies
        assert (asked["top_k"], asked["min_p"]) == (40, 0.05)
        assert "top_k" not in plain and "min_p" not in plain  # off: nothing a strict backend could refuse
    finally:
        engine.shutdown()
