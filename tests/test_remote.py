"""RemoteEngine: streaming from an OpenAI-compatible backend, cancel propagation, and backend failures."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fakes import WORDS, AppServer, FakeEngine
from helpers import ROOT, free_port, make_app, wait_for
from helpers import events_of as collect

from chat.config import Settings
from chat.engine import Delta, Done, GenParams, Refused, Started
from chat.engine.remote.client import RemoteEngine
from chat.errors import EngineUnavailable, Overloaded

HELLO = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]


def remote(url, **settings) -> RemoteEngine:
    """A RemoteEngine for ``url`` that has finished its first readiness probe."""
    engine = RemoteEngine(Settings(backend="openai", backend_url=url, **settings))
    wait_for(lambda: engine.ready or engine.error)
    return engine


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.fixture
def upstream_engine():
    return FakeEngine()


@pytest.fixture
def upstream(upstream_engine):
    server = AppServer(make_app(upstream_engine, max_new_tokens=64, api_key="up-key"))
    yield server
    server.close()


@pytest.fixture
def engine(upstream):
    engine = remote(f"{upstream.url}/v1", backend_api_key="up-key")
    yield engine
    engine.shutdown()


class Scripted(BaseHTTPRequestHandler):
    """A backend that answers /models, then streams ``script`` lines and misbehaves as told."""

    protocol_version = "HTTP/1.0"
    script: list = []
    then = "close"  # or "hang"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "scripted"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in self.script:
            self.wfile.write(line.encode())
            self.wfile.flush()
        if self.then == "hang":
            time.sleep(3)


@pytest.fixture
def scripted():
    """Start a scripted backend: ``scripted(lines, then)`` -> base URL."""
    servers = []

    def start(lines, then="close"):
        handler = type("Handler", (Scripted,), {"script": lines, "then": then})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def chunk(text):
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return f"data: {json.dumps({'choices': [choice]})}\n\n"


# ---- against this server's own /v1 with a fake engine behind it

def test_streams_answer_and_usage(engine, upstream_engine):
    assert engine.ready and engine.model_name == "fake-model" and engine.backend_model == "fake-model"
    params = GenParams(temperature=0.3, top_p=0.8, max_new_tokens=5, seed=11, stop=("zz",))
    events = collect(engine.submit(HELLO, params))
    assert events[0] == Started(0)
    assert text_of(events) == "".join(WORDS[:5])
    done = events[-1]
    assert done.reason == "length" and done.message is None
    assert done.usage == {"prompt_tokens": 2, "completion_tokens": 5}
    assert done.timings["total_ms"] >= done.timings["ttft_ms"] >= 0
    sent = upstream_engine.history[-1]
    assert sent.messages == HELLO
    assert (sent.params.temperature, sent.params.top_p, sent.params.max_new_tokens, sent.params.seed,
            sent.params.stop) == (0.3, 0.8, 5, 11, ("zz",))
    assert engine.stats() == {"active": 0, "queued": 0}


def test_stop_reason_passes_through(engine):
    events = collect(engine.submit(HELLO, GenParams(max_new_tokens=50, stop=("w2",))))
    assert text_of(events) == "w0 w1 " and events[-1].reason == "stop"


def test_display_name_and_fixed_model(upstream):
    engine = remote(f"{upstream.url}/v1", backend_api_key="up-key", backend_model="m1", model_name="Shown")
    assert engine.ready and engine.model_name == "Shown" and engine.backend_model == "m1"


def test_cancel_closes_upstream_promptly(engine, upstream_engine):
    upstream_engine.delay = 0.05
    gen = engine.submit(HELLO, GenParams(max_new_tokens=40))
    deltas = 0
    while deltas < 3:
        deltas += isinstance(gen.next_event(5), Delta)
    t0 = time.monotonic()
    gen.cancel()
    events = collect(gen, timeout=2)
    assert events[-1].reason == "cancelled" and time.monotonic() - t0 < 0.5
    assert wait_for(lambda: upstream_engine.stats()["active"] == 0)
    assert upstream_engine.history[-1].cancel_reason == "cancelled"
    assert engine.stats()["active"] == 0


def test_cancel_before_connect(engine, upstream_engine):
    gen = engine.submit(HELLO, GenParams())
    gen.cancel()
    assert collect(gen)[-1].reason == "cancelled"


def test_upstream_error_event_keeps_partial_text(engine, upstream_engine):
    upstream_engine.fail_after = 2
    events = collect(engine.submit(HELLO, GenParams()))
    assert text_of(events) == "w0 w1 "
    # The upstream (this server's /v1) names only its request id; the engine relays that to its log.
    assert events[-1].reason == "error" and "(request id chatcmpl-" in events[-1].message


def test_upstream_at_capacity_is_a_refusal_the_client_may_retry(engine, upstream_engine):
    upstream_engine.refuse = Overloaded("queue full")  # the upstream answers 503
    events = collect(engine.submit(HELLO, GenParams()))
    assert [type(e) for e in events] == [Refused]
    assert events[0].code == "overloaded" and "capacity" in events[0].message
    assert not engine.stats()["active"]


def test_upstream_http_error(engine, upstream_engine):
    upstream_engine.refuse = EngineUnavailable("the model failed to load")  # the upstream answers 500
    events = collect(engine.submit(HELLO, GenParams()))
    assert [type(e) for e in events] == [Done]
    assert events[0].reason == "error" and "500" in events[0].message


def test_wrong_backend_key_is_not_ready(upstream):
    engine = remote(f"{upstream.url}/v1", backend_api_key="nope")
    try:
        assert not engine.ready and "401" in engine.error
    finally:
        engine.shutdown()


def test_refused_connection():
    port = free_port()
    engine = remote(f"http://127.0.0.1:{port}/v1", backend_model="m")
    try:
        assert not engine.ready and engine.error
        events = collect(engine.submit(HELLO, GenParams()))
        assert events[-1].reason == "error" and "refused" in events[-1].message
    finally:
        engine.shutdown()


def test_becomes_ready_when_backend_appears(upstream_engine):
    port = free_port()
    engine = remote(f"http://127.0.0.1:{port}/v1")
    try:
        assert not engine.ready
        from werkzeug.serving import make_server
        server = make_server("127.0.0.1", port, make_app(upstream_engine), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert wait_for(lambda: engine.ready, timeout=8)
            assert engine.model_name == "fake-model" and engine.error is None
        finally:
            server.shutdown()
    finally:
        engine.shutdown()


def test_drop_mid_stream_keeps_partial_text(scripted):
    engine = remote(scripted([chunk("Hel"), chunk("lo")]))
    events = collect(engine.submit(HELLO, GenParams()))
    assert engine.model_name == "scripted"
    assert [type(e) for e in events] == [Started, Delta, Delta, Done]
    assert text_of(events) == "Hello"
    assert events[-1].reason == "error" and "dropped" in events[-1].message


def test_silence_beyond_backend_timeout(scripted):
    engine = remote(scripted([chunk("a")], then="hang"), backend_timeout_s=0.3)
    t0 = time.monotonic()
    events = collect(engine.submit(HELLO, GenParams()))
    assert time.monotonic() - t0 < 2
    assert text_of(events) == "a"
    assert events[-1].reason == "error" and "nothing for 0.3 s" in events[-1].message


def test_malformed_stream(scripted):
    engine = remote(scripted([chunk("a"), "data: {oops\n\n"]))
    events = collect(engine.submit(HELLO, GenParams()))
    assert events[-1].reason == "error" and "malformed" in events[-1].message


def test_bad_backend_url_fails_at_start():
    from chat.errors import ConfigError
    with pytest.raises(ConfigError, match="CHAT_BACKEND_URL"):
        RemoteEngine(Settings(backend="openai", backend_url="localhost:8000"))


def test_in_flight_limit_and_shutdown(engine, upstream_engine):
    engine.settings = engine.settings.replace(max_batch=1, max_queue=0)
    upstream_engine.delay = 0.05
    gen = engine.submit(HELLO, GenParams())
    with pytest.raises(Overloaded) as err:
        engine.submit(HELLO, GenParams())
    assert err.value.code == "overloaded"
    engine.shutdown()
    assert collect(gen)[-1].reason == "shutdown"
    with pytest.raises(Overloaded):
        engine.submit(HELLO, GenParams())


# ---- two real servers: B (CHAT_BACKEND=openai) in front of A (tiny model); fixtures in conftest.py

def front_for(server_factory, backend, name="front"):
    """A server B whose engine is A's /v1."""
    return server_factory(name, CHAT_BACKEND="openai", CHAT_BACKEND_URL=f"{backend.url}/v1",
                          CHAT_MAX_NEW_TOKENS=4096, CHAT_BACKEND_TIMEOUT_S=10, CHAT_RESUME_GRACE_S=3)


@pytest.fixture(scope="module")
def front(server_factory, server):
    return front_for(server_factory, server)


def ws_client(front):
    """A WebSocket client on B with an identity cookie, so its conversations can be read back."""
    from helpers import WS
    client = secrets.token_urlsafe(24)
    return WS(front.ws_url, cookie=f"chat_client={client}"), client


def stored_answer(front, client, conversation_id) -> dict:
    """The last message of a conversation as B stored it."""
    from helpers import http_get
    status, _, body = http_get(f"{front.url}/api/conversations/{conversation_id}",
                               headers={"Cookie": f"chat_client={client}"})
    assert status == 200, body
    return json.loads(body)["messages"][-1]


def active(server) -> float:
    from helpers import metric
    return metric(server, "chat_active_generations")


def test_front_answers_like_the_backend(front, server):
    import openai
    from helpers import text_of as ws_text
    ws, client = ws_client(front)
    try:
        assert ws.ready["model"] == server_model(server)
        frames = ws.chat("Tell me a story.", params={"temperature": 0, "max_new_tokens": 20})
    finally:
        ws.close()
    done = frames[-1]
    assert done["type"] == "done" and done["reason"] in ("stop", "length"), frames[-3:]
    assert done["usage"]["prompt_tokens"] > 0 and 0 < done["usage"]["completion_tokens"] <= 20
    text = ws_text(frames)
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    direct = sdk.chat.completions.create(model="any", temperature=0, max_tokens=20, messages=[
        {"role": "system", "content": Settings().system_prompt}, {"role": "user", "content": "Tell me a story."}])
    assert text == direct.choices[0].message.content
    start = next(f for f in frames if f["type"] == "start")
    stored = stored_answer(front, client, start["conversation_id"])
    assert (stored["role"], stored["content"], stored["status"]) == ("assistant", text, "complete")


def server_model(server) -> str:
    from helpers import http_get
    return json.loads(http_get(f"{server.url}/v1/models")[2])["data"][0]["id"]


def test_front_cancel_stops_the_backend(front, server):
    assert wait_for(lambda: active(server) == 0, timeout=15)
    ws, client = ws_client(front)
    try:
        ws.send({"type": "chat", "id": "long", "content": "Count to a thousand.",
                 "params": {"max_new_tokens": 4000, "temperature": 0}})
        ws.until(lambda f: f["type"] == "delta" and f["index"] == 2)
        assert active(server) == 1
        ws.send({"type": "cancel", "id": "long"})
        cancelled = time.monotonic()
        frames = ws.until(lambda f: f["type"] == "done")
    finally:
        ws.close()
    assert frames[-1]["reason"] == "cancelled"
    assert wait_for(lambda: active(server) == 0, timeout=5)
    assert time.monotonic() - cancelled < 2, "the backend kept generating after B's client cancelled"


def test_backend_killed_mid_stream(server_factory):
    backend = server_factory("doomed", CHAT_MAX_NEW_TOKENS=4096, CHAT_CONTEXT_TOKENS=8192)
    front = front_for(server_factory, backend, "orphan")
    ws, client = ws_client(front)
    try:
        ws.send({"type": "chat", "id": "r", "content": "Count to a thousand.",
                 "params": {"max_new_tokens": 4000, "temperature": 0}})
        frames = ws.until(lambda f: f["type"] == "delta" and f["index"] == 4)
        kill_tree(backend.proc.pid)
        frames += ws.until(lambda f: f["type"] in ("done", "error"))
    finally:
        ws.close()
    done = frames[-1]
    assert done["type"] == "done" and done["reason"] == "error", done
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert len(text) > 0
    start = next(f for f in frames if f["type"] == "start")
    stored = stored_answer(front, client, start["conversation_id"])
    assert (stored["content"], stored["status"], stored["reason"]) == (text, "partial", "error")
    assert "dropped" in front.log() or "backend" in front.log()


def kill_tree(pid: int) -> None:
    """SIGKILL gunicorn's master and its workers at once (a worker alone would be respawned)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    for p in (pid, *children):
        os.kill(p, signal.SIGKILL)


GREEN_SCRIPT = r"""
from gevent import monkey
monkey.patch_all()
import json, time
import gevent
from gevent.server import StreamServer
from chat.config import Settings
from chat.engine.remote.client import RemoteEngine
from chat.engine import Delta, Done, GenParams

def chunk(text):
    data = ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + "\n\n").encode()
    return b"%x\r\n%s\r\n" % (len(data), data)

closed = []
def handle(sock, _address):
    request = sock.recv(65536)
    if b"/models" in request.split(b"\r\n", 1)[0]:
        body = json.dumps({"data": [{"id": "green"}]}).encode()
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        return sock.close()
    mode = json.loads(request.split(b"\r\n\r\n", 1)[1])["messages"][-1]["content"]
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    sock.sendall(chunk("a"))
    if mode == "slow reader":
        for text in ("b", "c"):
            gevent.sleep(0.1)
            sock.sendall(chunk(text))
        data = b"data: [DONE]\n\n"
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    while sock.recv(100):  # hang until the client closes
        pass
    closed.append(mode)

server = StreamServer(("127.0.0.1", 0), handle)
server.start()
engine = RemoteEngine(Settings(backend="openai", backend_url=f"http://127.0.0.1:{server.server_port}/v1",
                               backend_timeout_s=0.3))
while not engine.ready:
    gevent.sleep(0.05)

def run(mode, on_delta=None):
    t0, seen = time.monotonic(), []
    gen = engine.submit([{"role": "user", "content": mode}], GenParams())
    def handle(event):
        seen.append(event)
        if isinstance(event, Delta) and on_delta:
            on_delta(gen)
    gen.consume(handle)
    done = seen[-1]
    gevent.sleep(0.2)
    return {"text": "".join(e.text for e in seen if isinstance(e, Delta)), "reason": done.reason,
            "message": done.message, "seconds": round(time.monotonic() - t0, 1), "upstream closed": mode in closed}

out = {"silent": run("silent"),
       "cancelled": run("cancelled", lambda gen: gevent.spawn_later(0.1, gen.cancel)),
       "slow reader": run("slow reader", lambda gen: gevent.sleep(0.5))}
print(json.dumps(out))
"""


def test_under_gevent_silence_times_out_cancel_wakes_the_read_and_a_slow_reader_is_not_silence():
    done = subprocess.run([sys.executable, "-c", GREEN_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    silent, cancelled, slow = out["silent"], out["cancelled"], out["slow reader"]
    assert (silent["text"], silent["reason"]) == ("a", "error") and "nothing for 0.3 s" in silent["message"]
    assert silent["seconds"] < 2 and silent["upstream closed"]
    assert (cancelled["text"], cancelled["reason"], cancelled["upstream closed"]) == ("a", "cancelled", True)
    assert cancelled["seconds"] < 1
    # 0.5 s handling each delta, the upstream never silent for 0.3 s: the time spent handling is not silence
    assert (slow["text"], slow["reason"], slow["message"]) == ("abc", "stop", None)
