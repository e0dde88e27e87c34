"""Issue 45's findings that need a real gunicorn + gevent server facing clients itself (no proxy):
bodies refused by their declared length before they are read, the body timeout on every body,
idle sockets closed after the header timeout, a per-address cap on open connections, one log line
per refusal instead of a traceback, and the database's and KV files' permissions."""
from __future__ import annotations

import json
import socket
import stat
import time

import pytest

from chat.client.session import ConnectFailed, Session, collect
from helpers import WS, http_get

SHORT = {"max_new_tokens": 2}


@pytest.fixture(scope="module")
def live(server_factory):
    return server_factory("hard45", CHAT_HEADER_TIMEOUT_S=2, CHAT_MAX_CONNECTIONS_PER_IP=8,
                          CHAT_BODY_TIMEOUT_S=3)


def _connect(srv, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", srv.port))
    return sock


def _answer(sock: socket.socket) -> tuple[bytes, float]:
    """(everything the server sends until it closes, seconds it took)."""
    t0, out = time.monotonic(), b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    except OSError:
        pass
    return out, time.monotonic() - t0


def _cookie(srv, source: str = "127.0.0.1") -> str:
    return http_get(srv.url + "/")[1]["Set-Cookie"].split(";")[0]


@pytest.mark.parametrize("method,path,declared", [
    ("PATCH", "/api/conversations/0123456789abcdef0123456789abcdef", 300 * 2**20),  # a 300 MB title
    ("POST", "/api/presets", 17 * 2**20),  # past the old 16 MiB bound, where the body timeout was skipped
    ("POST", "/api/conversations/import", 3 * 2**20),
    ("POST", "/v1/chat/completions", 17 * 2**20),
])
def test_a_declared_body_past_the_routes_bound_gets_413_before_a_byte_is_read(live, method, path, declared):
    sock = _connect(live)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\nCookie: {_cookie(live)}\r\n\r\n{{".encode())
    answer, took = _answer(sock)
    sock.close()
    assert answer.split(b" ", 2)[1] == b"413", answer[:200]
    assert b"too_large" in answer
    assert took < 10  # at once: nothing of the body was waited for (the body timeout is 3 s)


def test_a_stalled_api_body_gets_408(live):
    sock = _connect(live)
    sock.sendall(f"POST /api/presets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 5000\r\nCookie: {_cookie(live)}\r\n\r\n{{".encode())
    answer, took = _answer(sock)
    sock.close()
    assert answer.split(b" ", 2)[1] == b"408"
    assert took < 20


def test_a_silent_connection_is_closed_after_the_header_timeout(live):
    sock = _connect(live)
    answer, took = _answer(sock)  # sends nothing: gunicorn waited its keep-alive (75 s) before
    sock.close()
    assert answer == b"" and took < 20
    trickle = _connect(live)  # a request line a byte at a time: the deadline covers the whole head
    t0 = time.monotonic()
    try:
        for ch in b"GET /healthz HTTP/1.1\r\n":
            trickle.sendall(bytes([ch]))
            time.sleep(0.5)
    except OSError:
        pass
    answer, _ = _answer(trickle)
    trickle.close()
    assert b"200 OK" not in answer and time.monotonic() - t0 < 25


def test_one_address_holds_at_most_its_cap_of_connections_and_others_are_served(live):
    idle = [_connect(live) for _ in range(8)]
    try:
        time.sleep(0.3)  # each is accepted and counted
        extra = _connect(live)
        answer, took = _answer(extra)
        extra.close()
        assert answer.split(b" ", 2)[1] == b"429" and b"rate_limited" in answer and took < 5
        # another address is served at once, plain HTTP and WebSocket
        other = _connect(live, "127.0.0.2")
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _answer(other)[0].startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for s in idle:
            s.close()
    # the address's slots come back when its sockets close
    deadline = time.monotonic() + 10
    while http_get(live.url + "/healthz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    log = live.log_path.read_text()
    assert log.count("refused connections from 127.0.0.1") == 1  # one line, not one per socket


def test_a_websocket_counts_against_the_same_cap(live):
    clients = [WS(live.ws_url) for _ in range(8)]
    try:
        sock = _connect(live)
        assert _answer(sock)[0].split(b" ", 2)[1] == b"429"
        sock.close()
        with pytest.raises(ConnectFailed, match="429"):
            Session(live.ws_url, timeout=30).connect()
        # the client library from another address (its ``source``: how the benchmark's users are different
        # clients to the server) is served and answers
        with Session(live.ws_url, timeout=60, source="127.0.0.3") as other:
            done = collect(other.chat("Say hi.", params=SHORT)).done
        assert done["reason"] in ("stop", "length") and done["usage"]["completion_tokens"] >= 1
    finally:
        for c in clients:
            c.close()


def test_structured_refusals_log_one_line_not_a_traceback(live):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}})
    before = live.log_path.read_text().count("Traceback")
    sock = _connect(live)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    assert _answer(sock)[0].split(b" ", 2)[1] == b"400"
    sock.close()
    time.sleep(0.5)
    assert live.log_path.read_text().count("Traceback") == before


def test_the_database_and_kv_files_are_private(live):
    client = WS(live.ws_url, cookie=_cookie(live))
    client.chat("keep my words private", params=SHORT)
    client.close()
    data = live.workdir / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "chat.db").stat().st_mode) == 0o600


@pytest.fixture(scope="module")
def small_disk(server_factory):
    return server_factory("hard45disk", CHAT_DB_MAX_MB=2, CHAT_MAX_NEW_TOKENS=4096, CHAT_CONTEXT_TOKENS=8192)


def test_an_answer_that_streams_while_the_disk_fills_is_saved_when_space_returns(small_disk):
    import sqlite3
    cookie = _cookie(small_disk)
    client = WS(small_disk.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "long", "content": "tell me everything",
                 "params": {"temperature": 0, "max_new_tokens": 1500}})
    frames = client.until(lambda f: f["type"] == "delta")
    with sqlite3.connect(small_disk.workdir / "data" / "chat.db", timeout=10) as db:  # the disk fills meanwhile
        db.execute("INSERT INTO conversations (id, client_id, title, title_set, system, created_at, updated_at)"
                   " VALUES ('f' || hex(randomblob(15)), 'filler', 't', 1, NULL, 0, 0)")
        filler = db.execute("SELECT id FROM conversations WHERE client_id = 'filler'").fetchone()[0]
        while db.execute("PRAGMA page_count").fetchone()[0] * 4096 < 3 * 2**20:
            db.execute("INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
                       " VALUES (hex(randomblob(16)), ?, 'user', ?, 'complete', 0)", (filler, "z" * 200_000))
    frames += client.until(lambda f: f.get("id") == "long" and f["type"] in ("done", "error"))
    done = frames[-1]
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert done["type"] == "done" and done.get("stored") is False, done
    conv = next(f["conversation_id"] for f in frames if f["type"] == "start")

    def stored():
        status, _, body = http_get(f"{small_disk.url}/api/conversations/{conv}", headers={"Cookie": cookie})
        return [(m["role"], m["status"], m["content"]) for m in json.loads(body)["messages"]] if status == 200 else []
    assert stored()[-1][:2] == ("assistant", "streaming")
    with sqlite3.connect(small_disk.workdir / "data" / "chat.db", timeout=10) as db:  # space returns
        db.execute("DELETE FROM messages WHERE conversation_id = ?", (filler,))
        db.execute("DELETE FROM conversations WHERE id = ?", (filler,))
    deadline = time.monotonic() + 30
    while stored()[-1] != ("assistant", "complete", text):
        assert time.monotonic() < deadline, stored()[-1][:2]
        time.sleep(0.5)
    client.close()


@pytest.fixture(scope="module")
def defaults(server_factory):
    return server_factory("hard45defaults")  # the README's CHAT_BIND=0.0.0.0 case: no proxy, default limits


def test_a_thousand_idle_sockets_from_one_address_do_not_take_the_worker_offline(defaults):
    """The finding: 1001 idle TCP connections from one address held gevent's 1000 worker connections
    for 47 s and more (no deadline before the first request line, no per-address cap)."""
    idle = []
    try:
        for _ in range(1001):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(5)
            try:
                sock.connect(("127.0.0.1", defaults.port))
            except OSError:
                sock.close()
                continue
            idle.append(sock)
        t0 = time.monotonic()
        other = _connect(defaults, "127.0.0.2")
        other.settimeout(10)
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _answer(other)[0].startswith(b"HTTP/1.1 200")
        other.close()
        bystander = WS(defaults.ws_url, timeout=30, socket=_connect(defaults, "127.0.0.2"))
        frames = bystander.chat("hello", params=SHORT)
        bystander.close()
        assert frames[-1]["type"] == "done" and time.monotonic() - t0 < 30
    finally:
        for sock in idle:
            sock.close()
