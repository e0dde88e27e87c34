"""The command-line client: unit tests against a scripted fake server, end to end against the real one."""
from __future__ import annotations

import itertools
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from flask import Flask, abort, request
from flask_sock import Sock
from helpers import free_port
from werkzeug.serving import make_server

from chat import client

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


# ---------------------------------------------------------------- a fake server

class _Generation:
    """One scripted answer, attached to whichever connection last asked for it."""

    def __init__(self, id, conversation_id, pieces, delay, drop_after=None):
        self.id, self.conversation_id = id, conversation_id
        self.pieces, self.delay, self.drop_after = pieces, delay, drop_after
        self.sent: list[dict] = []
        self.done: dict | None = None
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        self.conn = None

    def emit(self, frame):
        with self.lock:
            if frame["type"] == "delta":
                self.sent.append(frame)
            elif frame["type"] == "done":
                self.done = frame
            if self.conn is not None:
                self.conn.send(frame)

    def run(self):
        self.emit({"type": "start", "id": self.id, "conversation_id": self.conversation_id,
                   "message_id": f"m-{self.id}"})
        reason = "stop"
        for index, piece in enumerate(self.pieces):
            if self.cancel.wait(self.delay):
                reason = "cancelled"
                break
            self.emit({"type": "delta", "id": self.id, "index": index, "text": piece})
            if index + 1 == self.drop_after:
                self.conn.kill()
        if self.pieces == ["!fail"]:
            reason = "error"
        self.emit({"type": "done", "id": self.id, "reason": reason,
                   "usage": {"prompt_tokens": 3, "completion_tokens": len(self.sent)},
                   "timings": {"ttft_ms": 1.0, "total_ms": 2.0, "tokens_per_s": 100.0}})

    def attach(self, conn, start):
        with self.lock:
            self.conn = conn
            for frame in self.sent[start:]:
                conn.send(frame)
            if self.done:
                conn.send(self.done)


class _Conn:
    """A server-side socket with a send lock (the generation threads share it)."""

    def __init__(self, ws):
        self.ws, self.lock, self.dead = ws, threading.Lock(), False

    def send(self, frame):
        with self.lock:
            if not self.dead:
                try:
                    self.ws.send(json.dumps(frame))
                except Exception:
                    self.dead = True

    def kill(self):
        """Drop the TCP connection without a close frame, as a network failure would."""
        self.dead = True
        self.ws.sock.shutdown(socket.SHUT_RDWR)


class FakeServer:
    """A scripted ``chat.v1`` server in a thread; the prompt picks the behaviour.

    ``boom`` → error frame, ``fail`` → done reason error, ``silent`` → nothing,
    ``slow`` → 300 deltas 20 ms apart, ``drop`` → the socket dies after 3
    deltas (resumable), anything else → "you said: <prompt>" word by word.
    """

    def __init__(self, api_key=None):
        self.api_key = api_key
        self.received: list[dict] = []
        self.headers: list[dict] = []
        self.generations: dict[str, _Generation] = {}
        self.conversations = itertools.count(1)
        app = Flask(__name__)
        sock = Sock(app)
        app.before_request(self._check_key)
        sock.route("/ws")(self._session)
        self.httpd = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"ws://127.0.0.1:{self.httpd.server_port}/ws"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _check_key(self):
        self.headers.append(dict(request.headers))
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            abort(401)

    def frames(self, kind):
        return [f for f in self.received if f.get("type") == kind]

    def _session(self, ws):
        conn = _Conn(ws)
        conn.send({"type": "ready", "protocol": "chat.v1", "model": "fake",
                   "limits": {"max_content_chars": 1000, "max_new_tokens": 512,
                              "context_tokens": 2048, "max_active_per_connection": 4}})
        while True:
            frame = json.loads(ws.receive())
            self.received.append(frame)
            kind = frame["type"]
            if kind == "chat":
                self._chat(conn, frame)
            elif kind == "cancel" and frame["id"] in self.generations:
                self.generations[frame["id"]].cancel.set()
            elif kind == "resume":
                self.generations[frame["id"]].attach(conn, frame["from"])
            elif kind == "ping":
                conn.send({"type": "pong", "t": frame.get("t")})

    def _chat(self, conn, frame):
        content, id = frame["content"], frame["id"]
        if content == "boom":
            return conn.send({"type": "error", "id": id, "code": "internal", "message": "it broke"})
        if content == "silent":
            return
        pieces, delay, drop = (f"you said: {content}").split(" "), 0.002, None
        pieces = [p + " " for p in pieces[:-1]] + pieces[-1:]
        if content == "slow":
            pieces, delay = [f"w{i} " for i in range(300)], 0.02
        elif content == "drop":
            pieces, delay, drop = [f"p{i} " for i in range(8)], 0.05, 3
        elif content == "fail":
            pieces = ["!fail"]
        conversation = frame.get("conversation_id") or f"conv-{next(self.conversations)}"
        gen = self.generations[id] = _Generation(id, conversation, pieces, delay, drop)
        gen.conn = conn
        threading.Thread(target=gen.run, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def run_cli(*args, input=None, timeout=30, env=None):
    """Run ``python -m chat.client`` in a subprocess."""
    return subprocess.run([PYTHON, "-m", "chat.client", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- unit tests (fake server)

def test_one_shot_prints_the_answer(fake, capsys):
    assert client.main(["hello", "there", "--url", fake.url]) == 0
    assert capsys.readouterr().out == "you said: hello there\n"


def test_prompt_from_stdin(fake):
    for args in (["-"], []):
        result = run_cli(*args, "--url", fake.url, input="piped question\n")
        assert result.returncode == 0, result.stderr
        assert result.stdout == "you said: piped question\n"


def test_json_prints_every_server_frame(fake, capsys):
    assert client.main(["hi", "--json", "--url", fake.url]) == 0
    frames = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [f["type"] for f in frames]
    assert kinds[:2] == ["ready", "start"] and kinds[-1] == "done"
    assert "".join(f["text"] for f in frames if f["type"] == "delta") == "you said: hi"


def test_params_and_system_are_sent(fake, capsys):
    assert client.main(["q", "--url", fake.url, "--system", "be brief", "--temperature", "0",
                        "--top-p", "0.5", "--max-tokens", "7", "--seed", "3"]) == 0
    chat = fake.frames("chat")[0]
    assert chat["system"] == "be brief"
    assert chat["params"] == {"temperature": 0.0, "top_p": 0.5, "max_new_tokens": 7, "seed": 3}


def test_no_origin_and_a_stable_identity_cookie(fake, capsys):
    assert client.main(["q", "--url", fake.url, "--client-id", "A" * 20]) == 0
    headers = fake.headers[-1]
    assert "Origin" not in headers
    assert headers["Cookie"] == "chat_client=" + "A" * 20


@pytest.mark.parametrize("prompt, args, code", [
    ("boom", [], client.EXIT_ERROR),
    ("fail", [], client.EXIT_ERROR),
    ("silent", ["--timeout", "0.5"], client.EXIT_TIMEOUT),
])
def test_exit_codes(fake, capsys, prompt, args, code):
    assert client.main([prompt, "--url", fake.url, *args]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("chat.client: ")


@pytest.mark.parametrize("args", [
    ["q", "--temperature", "3"], ["q", "--top-p", "0"], ["q", "--max-tokens", "0"],
    ["q", "--timeout", "0"], ["q", "--url", "ftp://x/ws"], ["q", "--nope"],
    ["load", "--concurrency", "0"], ["q", "--client-id", "short"],
])
def test_usage_errors_exit_2(args):
    result = run_cli(*args)
    assert result.returncode == client.EXIT_USAGE
    assert result.stdout == ""


def test_empty_stdin_is_a_usage_error():
    assert run_cli("-", input="  \n").returncode == client.EXIT_USAGE


def test_nothing_listening_exits_3():
    result = run_cli("hello", "--url", f"ws://127.0.0.1:{free_port()}/ws")
    assert result.returncode == client.EXIT_CONNECT
    assert "cannot connect" in result.stderr and result.stderr.count("\n") == 1


def test_handshake_refused_exits_3_and_the_key_gets_in():
    server = FakeServer(api_key="sekrit")
    try:
        refused = run_cli("hello", "--url", server.url)
        assert refused.returncode == client.EXIT_CONNECT
        assert "handshake refused: HTTP 401" in refused.stderr
        ok = run_cli("hello", "--url", server.url, env={"CHAT_API_KEY": "sekrit"})
        assert ok.returncode == 0 and ok.stdout == "you said: hello\n"
    finally:
        server.close()


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "http://127.0.0.1:8000", "ws://127.0.0.1:8000/"])
def test_url_normalisation(url):
    assert client.ws_url(url) == "ws://127.0.0.1:8000/ws"
    assert client.ws_url("https://h/chat/ws") == "wss://h/chat/ws"


def test_session_resumes_after_a_dropped_connection(fake):
    with client.Session(fake.url, timeout=10) as session:
        reply = session.ask("drop")
    assert reply["text"] == "".join(f"p{i} " for i in range(8))
    assert reply["done"]["reason"] == "stop"
    assert fake.frames("resume")[0]["from"] == 3


def test_sigint_cancels_and_exits_130(fake):
    proc = subprocess.Popen([PYTHON, "-m", "chat.client", "slow", "--url", fake.url], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    head = b""
    while b"w0 " not in head:  # streaming has begun
        chunk = os.read(proc.stdout.fileno(), 1024)
        assert chunk, proc.stderr.read()
        head += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == client.EXIT_INTERRUPTED, err
    gen = next(iter(fake.generations.values()))
    assert fake.frames("cancel") == [{"type": "cancel", "id": gen.id}]
    assert gen.done["reason"] == "cancelled"
    assert (head + out).decode() == "".join(f["text"] for f in gen.sent) + "\n"


def test_interactive_over_pipes_keeps_the_conversation(fake):
    result = run_cli("-i", "--url", fake.url, input="first\nsecond\n/new\nthird\n/quit\nnever\n")
    assert result.returncode == 0, result.stderr
    assert "you said: second" in result.stdout
    chats = fake.frames("chat")
    assert [c["content"] for c in chats] == ["first", "second", "third"]
    assert "conversation_id" not in chats[0]
    assert chats[1]["conversation_id"] == fake.generations[chats[0]["id"]].conversation_id
    assert "conversation_id" not in chats[2]


class Tty:
    """A client on a pseudo-terminal, as a user at a shell would run it."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            # As a shell starts it: Ctrl-C's signal neither ignored nor blocked, whatever this process did.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            os.execv(PYTHON, [PYTHON, "-m", "chat.client", *args])
        self.buf = b""

    def expect(self, needle: bytes, timeout=10.0) -> bytes:
        """Read until ``needle``; returns what came before it and consumes both."""
        deadline = time.monotonic() + timeout
        while needle not in self.buf:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"waited for {needle!r}, got {self.buf!r}"
            if select.select([self.fd], [], [], remaining)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                assert chunk, f"the client ended before {needle!r}: {self.buf!r}"
                self.buf += chunk
        before, _, self.buf = self.buf.partition(needle)
        return before

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_for_a_key(self, timeout=10.0) -> None:
        """Wait until the client's main thread blocks in readline's wait for a key (select/poll)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/wchan") as f:
                    wchan = f.read()
            except OSError:
                wchan = ""
            if "select" in wchan or "poll" in wchan:
                return
            time.sleep(0.01)
        raise AssertionError("the client never waited for a key")

    def wait(self, timeout=10.0) -> int:
        """The exit status, once the client has exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        while select.select([self.fd], [], [], 0)[0]:  # what it printed since, for the message
            try:
                self.buf += os.read(self.fd, 4096)
            except OSError:
                break
        try:
            with open(f"/proc/{self.pid}/status") as f:
                state = " ".join(line.strip() for line in f if line.startswith(("State", "Sig")))
            with open(f"/proc/{self.pid}/wchan") as f:
                state += f" wchan {f.read()}"
        except OSError:
            state = "?"
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the client did not exit; it printed {self.buf[-500:]!r}; {state}")


def test_interactive_on_a_tty_ctrl_c_cancels_then_quits(fake):
    tty = Tty("--url", fake.url)
    tty.expect(b"> ")
    tty.write(b"hello\r")
    tty.expect(b"you said: hello")
    tty.expect(b"> ")
    tty.write(b"slow\r")
    tty.expect(b"w2 ")
    tty.write(b"\x03")  # Ctrl-C: cancel this answer, stay
    tty.expect(b"cancelled")
    tty.expect(b"> ")
    tty.write(b"again\r")
    tty.expect(b"you said: again")
    tty.expect(b"> ")
    # CPython's readline misses a SIGINT that lands between printing the prompt
    # and waiting for a key; a person is never that fast.
    tty.wait_for_a_key()
    tty.write(b"\x03")  # Ctrl-C at the prompt: quit
    assert tty.wait() == 0
    chats = fake.frames("chat")
    assert [c["content"] for c in chats] == ["hello", "slow", "again"]
    assert fake.generations[chats[1]["id"]].done["reason"] == "cancelled"
    assert chats[2]["conversation_id"] == fake.generations[chats[0]["id"]].conversation_id


def test_load_mode_json(fake):
    result = run_cli("load", "--url", fake.url, "-c", "3", "-n", "7", "--prompt", "hey", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] == 7 and summary["failed"] == 0 and summary["errors"] == {}
    assert summary["completion_tokens"] == 7 * 3
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p95"] <= summary["ttft_ms"]["max"]
    assert len({c["id"] for c in fake.frames("chat")}) == 7


def test_load_mode_counts_errors_by_code(fake):
    result = run_cli("load", "--url", fake.url, "-c", "2", "-n", "4", "--prompt", "boom")
    assert result.returncode == client.EXIT_ERROR
    assert "errors: internal=4" in result.stdout
    assert "time to first delta" in result.stdout


# ---------------------------------------------------------------- end to end (real gunicorn server)

def _get_json(base_url: str, path: str, client_id: str):
    """GET an API path as the client with this identity cookie."""
    import urllib.request
    req = urllib.request.Request(base_url + path, headers={"Cookie": f"chat_client={client_id}"})
    with urllib.request.urlopen(req, timeout=10) as response:
        return json.loads(response.read())


def _answer_stored(server, client_id: str, conversation_id: str) -> str:
    conv = _get_json(server.url, f"/api/conversations/{conversation_id}", client_id)
    return conv["messages"][-1]["content"]


def test_e2e_one_shot_output_is_the_deltas_and_the_stored_answer(server):
    who = "e2e-one-shot-client-1"
    common = ["--url", server.ws_url, "--client-id", who, "--temperature", "0", "--max-tokens", "24"]
    raw = run_cli("Say hello.", "--json", *common)
    assert raw.returncode == 0, raw.stderr
    frames = [json.loads(line) for line in raw.stdout.splitlines()]
    assert frames[0]["type"] == "ready" and frames[0]["protocol"] == "chat.v1"
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] in ("stop", "length")
    deltas = [f for f in frames if f["type"] == "delta"]
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    text = "".join(d["text"] for d in deltas)
    assert text

    plain = run_cli("Say hello.", *common)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == text + ("" if text.endswith("\n") else "\n")  # greedy: the same answer
    start = next(f for f in frames if f["type"] == "start")
    assert _answer_stored(server, who, start["conversation_id"]) == text


def test_e2e_sigint_cancels_on_the_server_and_exits_130(server):
    who = "e2e-sigint-client-01"
    proc = subprocess.Popen([PYTHON, "-m", "chat.client", "Count to a million.", "--json",
                             "--url", server.ws_url, "--client-id", who, "--max-tokens", "4000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    head = b""
    while b'"type": "delta"' not in head and b'"type":"delta"' not in head:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, proc.stderr.read()
        head += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == client.EXIT_INTERRUPTED, err
    frames = [json.loads(line) for line in (head + out).decode().splitlines()]
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 4000
    start = next(f for f in frames if f["type"] == "start")
    partial = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert _answer_stored(server, who, start["conversation_id"]) == partial


def test_e2e_interactive_keeps_the_conversation_until_new(server):
    result = run_cli("-i", "--json", "--url", server.ws_url, "--max-tokens", "8",
                     input="Hi.\nAnd then?\n/new\nHello again.\n/quit\n", timeout=60)
    assert result.returncode == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    starts = [f for f in frames if f["type"] == "start"]
    assert len(starts) == 3 and len([f for f in frames if f["type"] == "done"]) == 3
    assert starts[0]["conversation_id"] == starts[1]["conversation_id"] != starts[2]["conversation_id"]


def test_e2e_load_mode(server):
    result = run_cli("load", "--url", server.ws_url, "-c", "4", "-n", "8", "--max-tokens", "8",
                     "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] == 8 and summary["errors"] == {}
    assert summary["completion_tokens"] > 0 and summary["aggregate_tokens_per_s"] > 0
    assert summary["ttft_ms"]["max"] is not None


def test_e2e_session_resumes_a_stream_after_the_socket_dies(server):
    session = client.Session(server.ws_url, timeout=30)
    session.connect()
    frames = []
    try:
        for frame in session.chat("Tell me a story.", params={"max_new_tokens": 48, "temperature": 0}):
            frames.append(frame)
            if frame["type"] == "delta" and frame["index"] == 2:
                session.ws.sock.shutdown(socket.SHUT_RDWR)  # the network fails mid-answer
    finally:
        session.close()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] in ("stop", "length")
    deltas = [f for f in frames if f["type"] == "delta"]
    assert [f["index"] for f in deltas] == list(range(len(deltas)))
    start = next(f for f in frames if f["type"] == "start")
    stored = _answer_stored(server, session.client_id, start["conversation_id"])
    assert "".join(f["text"] for f in deltas) == stored


def test_load_mode_counts_refused_connections_and_exits_3():
    server = FakeServer(api_key="k")
    try:
        result = run_cli("load", "--url", server.url, "-c", "2", "-n", "3", "--json")
        summary = json.loads(result.stdout)
        assert result.returncode == client.EXIT_CONNECT
        assert summary["errors"] == {"connect": 3} and summary["ok"] == 0
    finally:
        server.close()


def test_e2e_interactive_edit_continue_search(server):
    result = run_cli("-i", "--json", "--url", server.ws_url, "--max-tokens", "8",
                     input="alpha question\n/continue\n/edit beta question\n/search beta\n/open 1\n"
                           "/open 9\nand then?\n/quit\n", timeout=90)
    assert result.returncode == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    starts = [f for f in frames if f["type"] == "start"]
    assert len(starts) == 4 and [f["type"] for f in frames].count("done") == 4
    chat, more, edit, follow = starts
    assert more["message_id"] == chat["message_id"]  # /continue extends the same answer
    assert edit["message_id"] != chat["message_id"]
    assert len({s["conversation_id"] for s in starts}) == 1
    assert "[beta] question" in result.stderr and "usage: /open N" in result.stderr
