"""Helpers shared by the test modules: they import what they share from here, never from one another;
fixtures live in conftest.py. The live gunicorn server is harness.LiveServer (the benchmark starts its
server with it too), re-exported here.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import websocket

from harness.live_server import GUNICORN, ROOT, LiveServer, free_port  # noqa: F401  (the tests import them here)

ARTIFACTS = ROOT / "tests" / "artifacts"


# ---------------------------------------------------------------- ports, HTTP, polling

def http_get(url: str, timeout: float = 10, headers=None):
    """(status, headers, body bytes) of a GET, errors included."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def wait_for(predicate, timeout=3.0):
    """Poll until ``predicate()`` is true; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def until(predicate, timeout: float = 10.0, interval: float = 0.02):
    """``predicate()``'s first true value, polled every ``interval`` s; its last value on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metric(server, name: str, labels: str = "") -> float:
    """One sample from /metrics. A labelled sample counts 0 while absent (a labelled counter appears
    once it is first counted); an unlabelled one is always exported, so its absence fails."""
    status, _, body = http_get(server.url + "/metrics")
    text = body.decode()
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", re.M)
    match = pattern.search(text)
    if match:
        return float(match.group(1))
    assert labels, f"{name} not in /metrics ({status}): {text[:300]!r}"
    return 0.0


def at_rest(server, hold: float = 1.0, timeout: float = 60) -> dict:
    """The server at rest, polled: nothing running or queued, no socket open, and its threads and
    greenlets unchanged for ``hold`` s (make it longer than the resume grace: a finished run is kept
    that long). Returns those samples and the resident memory then."""
    names = ("chat_os_threads", "chat_greenlets", "process_resident_memory_bytes")
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        busy = any(metric(server, m) for m in ("chat_active_generations", "chat_queue_depth", "chat_ws_connections"))
        now = {m: metric(server, m) for m in names[:2]}
        if busy or now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= hold:
            return {**now, names[2]: metric(server, names[2])}
        assert time.monotonic() < deadline, f"not at rest in {timeout} s: {now}, busy {busy}"
        time.sleep(0.1)


def handshake_status(url: str, **kwargs) -> int:
    """101 when the upgrade succeeds, else the HTTP status the server refused with."""
    try:
        conn = websocket.create_connection(url, timeout=10, **kwargs)
    except websocket.WebSocketBadStatusException as exc:
        return exc.status_code
    conn.close()
    return 101


# ---------------------------------------------------------------- a chat.v1 client and its frames

class WS:
    """A test WebSocket client speaking chat.v1 (a real client: websocket-client)."""

    def __init__(self, url: str, timeout: float = 30, **kwargs):
        self.conn = websocket.create_connection(url, timeout=timeout, **kwargs)
        self.ready = self.recv()
        assert self.ready["type"] == "ready", self.ready

    def send(self, frame) -> None:
        self.conn.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame),
                       opcode=websocket.ABNF.OPCODE_BINARY if isinstance(frame, bytes) else websocket.ABNF.OPCODE_TEXT)

    def recv(self) -> dict:
        return json.loads(self.conn.recv())

    def until(self, predicate, limit: int = 100000) -> list[dict]:
        """Frames received up to and including the first that matches."""
        frames = []
        for _ in range(limit):
            frame = self.recv()
            frames.append(frame)
            if predicate(frame):
                return frames
        raise AssertionError(f"no matching frame in {frames[-5:]}")

    def chat(self, content: str, rid: str = "r1", **fields) -> list[dict]:
        """Send a chat and return every frame up to its ``done`` (or its error)."""
        self.send({"type": "chat", "id": rid, "content": content, **fields})
        return self.until(lambda f: f.get("id") == rid and f["type"] in ("done", "error"))

    def ping(self) -> dict:
        self.send({"type": "ping", "t": 7})
        return self.until(lambda f: f["type"] == "pong")[-1]

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


def text_of(frames) -> str:
    """The answer: every delta's text in index order."""
    deltas = sorted((f for f in frames if f["type"] == "delta"), key=lambda f: f["index"])
    assert [f["index"] for f in deltas] == list(range(len(deltas))), "delta indexes have gaps"
    return "".join(f["text"] for f in deltas)


def start_of(frames) -> dict:
    """The ``start`` frame among a request's frames (``queued`` may come first on a busy server)."""
    return next(f for f in frames if f["type"] == "start")


def conv_of(frames) -> str:
    return start_of(frames)["conversation_id"]


def in_threads(target, count: int, timeout: float = 120) -> None:
    """Run ``target(i)`` for i in range(count) on parallel threads and wait for all."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def cookie_for(server) -> str:
    """A browser-like identity: the cookie GET / hands out."""
    status, headers, _ = http_get(server.url + "/")
    assert status == 200
    return headers["Set-Cookie"].split(";")[0]


def conversation(server, cookie, conv):
    """(status, body) of GET /api/conversations/<conv> as the client with ``cookie``."""
    status, _, body = http_get(f"{server.url}/api/conversations/{conv}", headers={"Cookie": cookie})
    return status, json.loads(body)


def wait_settled(server, cookie, conv, timeout=30):
    """The conversation once its last answer is no longer streaming."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = conversation(server, cookie, conv)[1]
        if data["messages"] and data["messages"][-1]["status"] != "streaming":
            return data
        time.sleep(0.1)
    raise AssertionError("answer still streaming")


# ---------------------------------------------------------------- scenarios several modules run

GREEDY = {"temperature": 0, "max_new_tokens": 40}
LONG = {"temperature": 0.8, "seed": 5, "max_new_tokens": 4000}


def chat_streams_and_stores_the_answer(server) -> None:
    """start, deltas, one done; the stored answer is the deltas joined."""
    cookie = cookie_for(server)
    client = WS(server.ws_url, cookie=cookie)
    frames = client.chat("Hello there", params=GREEDY)
    kinds = [f["type"] for f in frames if f["type"] != "queued"]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("done") == 1
    start, done = start_of(frames), frames[-1]
    assert done["reason"] == "length"
    assert done["usage"]["completion_tokens"] == 40 and done["usage"]["prompt_tokens"] > 0
    assert set(done["timings"]) == {"ttft_ms", "total_ms", "tokens_per_s"}
    answer = text_of(frames)
    assert answer
    status, _, body = http_get(f"{server.url}/api/conversations/{start['conversation_id']}",
                               headers={"Cookie": cookie})
    messages = json.loads(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Hello there"
    assert messages[1]["content"] == answer and messages[1]["id"] == start["message_id"]
    client.close()


def resume_after_forced_drops(server, others=()) -> None:
    """Drop the socket four times mid-answer; resuming loses and repeats nothing.

    With ``others`` (servers sharing state), each reconnection goes to the next server in turn.
    """
    servers = [server, *others]
    cookie = cookie_for(server)
    client = WS(server.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "res", "content": "go on", "params": {**LONG, "max_new_tokens": 400}})
    got = {}
    conv = None
    for drop in range(4):
        while True:
            frame = client.recv()
            if frame["type"] == "start":
                conv = frame["conversation_id"]
            if frame["type"] == "delta":
                assert frame["index"] not in got, "delta repeated"
                got[frame["index"]] = frame["text"]
                if len(got) >= 20 * (drop + 1):
                    break
            if frame["type"] == "done":
                break
        if frame["type"] == "done":
            break
        client.conn.sock.close()  # no close frame: like a network loss
        client = WS(servers[(drop + 1) % len(servers)].ws_url, cookie=cookie)
        client.send({"type": "resume", "id": "res", "from": len(got)})
    if frame["type"] != "done":
        frames = client.until(lambda f: f["type"] == "done")
        for f in frames:
            if f["type"] == "delta":
                assert f["index"] not in got, "delta repeated"
                got[f["index"]] = f["text"]
        frame = frames[-1]
    client.close()
    assert frame["reason"] == "length" and sorted(got) == list(range(len(got)))
    stored = wait_settled(server, cookie, conv)["messages"][-1]
    assert stored["content"] == "".join(got[i] for i in range(len(got)))


def finished_answer_resumes(server, other=None) -> None:
    """A finished answer resumed within the grace (on ``other`` when given, a worker sharing state)
    replays exactly the deltas from ``from``, then the same ``done``."""
    cookie = cookie_for(server)
    client = WS(server.ws_url, cookie=cookie)
    frames = client.chat("short", rid="fin", params={"temperature": 0, "max_new_tokens": 15})
    client.close()
    again = WS((other or server).ws_url, cookie=cookie)
    again.send({"type": "resume", "id": "fin", "from": 3})
    replay = again.until(lambda f: f["type"] == "done")
    deltas = sum(1 for f in frames if f["type"] == "delta")
    assert [f["index"] for f in replay[:-1]] == list(range(3, deltas))
    assert "".join(f["text"] for f in replay[:-1]) == text_of(frames)[len("".join(
        f["text"] for f in frames if f["type"] == "delta" and f["index"] < 3)):]
    assert replay[-1] == frames[-1]
    again.close()


def cancel_and_stop_from_the_other(a, b) -> None:
    """An answer running on ``a``: cancel sent on ``b`` ends it; so does stop on ``b``, on the socket
    that resumed it there."""
    cookie = cookie_for(a)
    runner = WS(a.ws_url, cookie=cookie)
    runner.send({"type": "chat", "id": "long", "content": "go", "params": LONG})
    runner.until(lambda f: f["type"] == "delta")
    other = WS(b.ws_url, cookie=cookie)
    other.send({"type": "cancel", "id": "long"})
    assert runner.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    runner.send({"type": "chat", "id": "again", "content": "go", "params": LONG})
    runner.until(lambda f: f["type"] == "delta")
    runner.conn.sock.close()
    follower = WS(b.ws_url, cookie=cookie)
    follower.send({"type": "resume", "id": "again", "from": 0})
    follower.until(lambda f: f["type"] == "delta")
    follower.send({"type": "stop"})
    assert follower.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    other.close()


def two_sockets_follow_one_answer(server, other=None) -> None:
    """A second socket of the same client (on ``other``, a worker sharing state, when given)
    resumes a running answer: both stream it to the end, either may cancel it, each gets its
    own ``done``; the conversation names the running request for the second to find."""
    cookie = cookie_for(server)
    first = WS(server.ws_url, cookie=cookie)
    first.send({"type": "chat", "id": "both", "content": "go on", "params": LONG})
    conv = first.until(lambda f: f["type"] == "start")[-1]["conversation_id"]
    first.until(lambda f: f["type"] == "delta" and f["index"] >= 5)
    status, _, body = http_get(f"{(other or server).url}/api/conversations/{conv}", headers={"Cookie": cookie})
    answering = json.loads(body)["answering"]
    assert status == 200 and answering["id"] == "both" and answering["prefix_chars"] == 0
    listed = json.loads(http_get(f"{(other or server).url}/api/conversations", headers={"Cookie": cookie})[2])
    assert [c["answering"] for c in listed if c["id"] == conv] == [True]
    second = WS((other or server).ws_url, cookie=cookie)
    second.send({"type": "resume", "id": "both", "from": 0})
    replayed = second.until(lambda f: f["type"] == "delta" and f["index"] >= 40)
    second.send({"type": "cancel", "id": "both"})
    seen = [first.until(lambda f: f["type"] == "done"), replayed + second.until(lambda f: f["type"] == "done")]
    for frames in seen:
        assert frames[-1]["reason"] == "cancelled"
        assert sum(1 for f in frames if f["type"] == "done") == 1
    first_deltas = [f for f in seen[0] if f["type"] == "delta"]  # the first's since index 6
    assert [f["index"] for f in first_deltas] == list(range(6, 6 + len(first_deltas)))
    first_text = "".join(f["text"] for f in first_deltas)
    second_deltas = {f["index"]: f["text"] for f in seen[1] if f["type"] == "delta"}
    assert sorted(second_deltas) == list(range(len(second_deltas)))
    whole = "".join(second_deltas[i] for i in range(len(second_deltas)))
    assert whole.endswith(first_text) and len(whole) > len(first_text)
    assert wait_settled(server, cookie, conv)["messages"][-1]["content"] == whole
    status, _, body = http_get(f"{server.url}/api/conversations/{conv}", headers={"Cookie": cookie})
    assert json.loads(body)["answering"] is None
    first.close()
    second.close()


def one_of_two_sockets_leaves(server, other=None) -> None:
    """Of two sockets following one answer, the one that started it goes away: the other
    follows it to its end (no cancel after the grace), which it gets as its ``done``."""
    cookie = cookie_for(server)
    first = WS(server.ws_url, cookie=cookie)
    first.send({"type": "chat", "id": "stay", "content": "go on",
                "params": {**LONG, "max_new_tokens": 1500}})
    first.until(lambda f: f["type"] == "delta")
    second = WS((other or server).ws_url, cookie=cookie)
    second.send({"type": "resume", "id": "stay", "from": 0})
    second.until(lambda f: f["type"] == "delta")
    first.conn.sock.close()  # no close frame: like a tab killed
    frames = second.until(lambda f: f["type"] == "done")
    assert frames[-1]["reason"] == "length" and frames[-1]["usage"]["completion_tokens"] == 1500
    second.close()


# ---------------------------------------------------------------- engines and apps in this process

def make_app(engine, **settings):
    """The whole app around ``engine``, with an in-memory store."""
    from chat import create_app
    from chat.config import Settings
    from chat.store import Store
    return create_app(Settings(**settings), engine=engine, store=Store(":memory:"))


def wait_ready(engine, timeout=120):
    deadline = time.monotonic() + timeout
    while not engine.ready:
        assert engine.error is None, engine.error
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return engine


def make_engine(tiny_model, tmp_path, **overrides):
    """The local engine on the tiny model, loaded and ready; torch's decode step unless ``native=True``
    (the C++ step switches in while the engine is idle, which a test must wait for: test_native.py)."""
    from chat.config import Settings
    from chat.engine.core.local import LocalEngine
    overrides = {"dtype": "float32", "native": False, "max_new_tokens": 4096, "context_tokens": 8192, "threads": 1,
                 **overrides}
    settings = Settings.from_env({}, model=str(tiny_model), data_dir=str(tmp_path), **overrides)
    return wait_ready(LocalEngine(settings))


def ask(text, system="You are terse."):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def collect(gen):
    """(the answer's text, every event) of a generation, iterated to its end."""
    from chat.engine import Delta
    events = list(gen)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    return text, events


QUESTIONS = ["hello", "what is two plus two", "tell me a story about a cat", "why is the sky blue"]


def events_of(gen, timeout=10.0):
    """Every event of ``gen`` (fails the test if its end does not come in time)."""
    from chat.engine import Done, Refused
    events = []
    deadline = time.monotonic() + timeout
    while not events or not isinstance(events[-1], (Done, Refused)):
        event = gen.next_event(max(deadline - time.monotonic(), 0))
        assert event is not None, f"no done within {timeout} s; got {events}"
        events.append(event)
    return events


# ---------------------------------------------------------------- an upstream serving several models

UPSTREAM_MODELS = ["qwen2.5:0.5b", "llama3.2:1b", "qwen2.5:7b", "embed-only"]


class Upstream(BaseHTTPRequestHandler):
    """An OpenAI-compatible backend serving several models: it lists ``models`` and answers each
    completion with the name of the model it was asked for."""

    protocol_version = "HTTP/1.0"
    models: list = UPSTREAM_MODELS
    asked: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
        self.asked.append(model)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta, finish in (({"content": f"I am {model}."}, None), ({}, "stop")):
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


class ThinkingUpstream(Upstream):
    """An OpenAI-compatible backend whose model thinks as Qwen3 does, and whose server leaves the
    ``<think>`` block in the content (llama.cpp's with ``--reasoning-format none``), cut in awkward places.
    ``enable_thinking`` false (``chat_template_kwargs``) or ``/no_think`` in the question: an empty block, as
    Qwen3 writes then; "long" in the question: thinking that goes on (for Stop). Each body is kept in ``asked``."""

    delay: float = 0.05
    THOUGHT = ["<th", "ink>", "\nThe user", " asks; let me", " think. 2 <", " 3 is true.\n</", "thi", "nk>\n",
               "\nIt is", " **true**: 2 < 3."]

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.asked.append(body)
        question = body["messages"][-1]["content"]
        off = (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False or "/no_think" in question
        if off:
            pieces = ["<think>\n\n</think>\n\n", "Plainly: ", "true."]
        elif "long" in question:
            pieces = ["<think>\nStep"] + [f" {i}." for i in range(2000)] + ["</think>never"]
        else:
            pieces = self.THOUGHT
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for piece in pieces:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
                time.sleep(self.delay)
            choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode())
        except OSError:  # the server hung up (Stop)
            pass


def start_upstream(handler):
    """Serve ``handler`` (an ``Upstream`` class) on a free port in a thread; the server."""
    from http.server import ThreadingHTTPServer
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    return upstream


# ---------------------------------------------------------------- the store's fixtures' helpers

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"
LIMIT = 1000


def add_answer(store, conv_id, text, reason="stop", parent=None):
    """A finished assistant message; its id."""
    mid = store.start_assistant(conv_id, parent)
    store.finish_assistant(mid, text, reason, {"prompt_tokens": 1, "completion_tokens": 1}, {})
    return mid


def error_code(call, *args, **kwargs):
    """The code of the ProtocolError that ``call(*args, **kwargs)`` raises (fails if none)."""
    from chat.errors import ProtocolError
    try:
        call(*args, **kwargs)
    except ProtocolError as exc:
        return exc.code
    raise AssertionError(f"{getattr(call, '__name__', call)} raised no ProtocolError")


# ---------------------------------------------------------------- the page in a browser

class Chat:
    """A fresh browser context (own cookie = own identity, own localStorage) on the chat page."""

    def __init__(self, browser, url: str, width: int = 1200, height: int = 800, settings=None, context=None):
        self.url = url
        self.own_context = context is None
        self.context = context or browser.new_context(viewport={"width": width, "height": height})
        if settings is not None:
            self.context.add_init_script(
                f"localStorage.setItem('chat.settings', {json.dumps(json.dumps(settings))})")
        self.page = self.context.new_page()
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.page.on("dialog", self._dialog)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on("console", self._console)

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        if dialog.type == "confirm":
            dialog.accept()
        else:
            dialog.dismiss()

    def _console(self, msg) -> None:
        if msg.type == "error" and "Content Security Policy" in msg.text:
            self.errors.append(f"csp: {msg.text}")

    def tab(self) -> "Chat":
        """Another tab of the same person (same cookie, same localStorage), not opened yet."""
        other = Chat(None, self.url, context=self.context)
        other.errors = self.errors
        return other

    def open(self, path: str = "/") -> "Chat":
        self.page.goto(self.url + path)
        self.page.wait_for_selector("[data-testid=connection-status][data-state=open]", timeout=30000)
        return self

    def js(self, expression: str, arg=None):
        return self.page.evaluate(expression, arg)

    def wait_until(self, expression: str, timeout: float = 30, arg=None):
        """Poll a JS expression (the page's CSP forbids Playwright's eval-based waiters)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression, arg)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for: {expression}")

    def send(self, text: str) -> None:
        self.page.fill("[data-testid=prompt]", text)
        self.page.keyboard.press("Enter")

    def wait_done(self, timeout: float = 60) -> str:
        """Wait until the last answer is finished; return its reason."""
        return self.wait_until(
            """() => { const m = [...document.querySelectorAll('[data-testid=message-assistant]')].pop();
                       return m && m.dataset.state === 'done' && (m.dataset.reason || 'none'); }""", timeout)

    def answer(self) -> str:
        """The raw (Markdown) text of the last answer, as the page holds it."""
        return self.js("""() => { const m = [...document.querySelectorAll('[data-testid=message-assistant]')].pop();
                                  return m ? m.view.text : null; }""")

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"))

    def close(self) -> None:
        if self.own_context:
            self.context.close()
        else:
            self.page.close()


# ---------------------------------------------------------------- tools the structured-answer tests offer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"], "additionalProperties": False}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}  # a tool_choice naming it
