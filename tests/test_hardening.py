"""Attacks from the abuse review, each performed against a real server and shown to fail."""
from __future__ import annotations

import json
import socket
import sqlite3
import time
import urllib.request
import uuid

import pytest
import websocket
from helpers import WS, conv_of, handshake_status, http_get

KEY = "s3cret-key_0123"
SHORT = {"max_new_tokens": 2}
VICTIM = "victim-client-0123456789"


def http(method: str, url: str, body: bytes | None = None, headers=None):
    """(status, headers, body) of any request, errors included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def page_cookie(srv, **headers) -> str:
    """The identity cookie GET / hands a browser (name=value)."""
    return http_get(srv.url + "/", headers=headers)[1]["Set-Cookie"].split(";")[0]


def db_of(srv) -> sqlite3.Connection:
    return sqlite3.connect(srv.workdir / "data" / "chat.db", timeout=10)


@pytest.fixture(scope="module")
def keyed(server_factory):
    """A server with an API key behind one trusted proxy, small quotas and a 2 MB database cap."""
    return server_factory("keyed", CHAT_API_KEY=KEY, CHAT_TRUSTED_PROXIES=1, CHAT_MAX_CONVERSATIONS=3,
                          CHAT_MAX_MESSAGES=4, CHAT_DB_MAX_MB=2)


# ---- 2. storage: no unreachable rows, quotas, a full disk

def test_cookieless_conversations_are_deleted_after_the_connection(server):
    client = WS(server.ws_url)  # no cookie: an identity for this connection only
    conv = conv_of(client.chat("remember me", params=SHORT))
    client.close()
    deadline = time.monotonic() + 30
    with db_of(server) as db:
        while db.execute("SELECT count(*) FROM conversations WHERE id = ?", (conv,)).fetchone()[0]:
            assert time.monotonic() < deadline, "an unreachable conversation was kept"
            time.sleep(0.2)
        assert db.execute("SELECT count(*) FROM messages WHERE conversation_id = ?", (conv,)).fetchone()[0] == 0


def test_quotas_refuse_with_too_large_and_keep_the_rest(keyed):
    bearer = [f"Authorization: Bearer {KEY}"]
    client = WS(keyed.ws_url, header=bearer, cookie="chat_client=quota-program-0123456")
    convs = [conv_of(client.chat(f"topic {i}", rid=f"n{i}", params=SHORT)) for i in range(3)]
    refused = client.chat("one too many", rid="n3", params=SHORT)[-1]
    assert (refused["type"], refused["code"], refused["id"]) == ("error", "too_large", "n3")
    assert "conversations" in refused["message"]
    assert client.chat("second turn", rid="t2", conversation_id=convs[0], params=SHORT)[-1]["type"] == "done"
    full = client.chat("third turn", rid="t3", conversation_id=convs[0], params=SHORT)[-1]
    assert (full["type"], full["code"], full["id"]) == ("error", "too_large", "t3")
    assert client.ping()["type"] == "pong"
    client.close()
    status, _, body = http_get(f"{keyed.url}/api/conversations/{convs[0]}",
                               headers={"Authorization": f"Bearer {KEY}",
                                        "Cookie": "chat_client=quota-program-0123456"})
    assert status == 200 and [m["content"] for m in json.loads(body)["messages"]][::2] == ["topic 0", "second turn"]


def test_full_disk_refuses_new_messages_and_loses_nothing(keyed):
    cookie = page_cookie(keyed)
    client = WS(keyed.ws_url, cookie=cookie)
    conv = conv_of(client.chat("before the disk filled", rid="b1", params=SHORT))
    with db_of(keyed) as db:  # someone else fills the 2 MB the server may use
        db.execute("INSERT INTO conversations (id, client_id, title, title_set, system, created_at, updated_at)"
                   " VALUES ('f' || hex(randomblob(15)), 'filler', 't', 1, NULL, 0, 0)")
        filler = db.execute("SELECT id FROM conversations WHERE client_id = 'filler'").fetchone()[0]
        while db.execute("PRAGMA page_count").fetchone()[0] * 4096 < 3 * 2**20:
            db.execute("INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
                       " VALUES (hex(randomblob(16)), ?, 'user', ?, 'complete', 0)", (filler, "z" * 200_000))
    refused = client.chat("hello " * 700, rid="b2", conversation_id=conv, params=SHORT)[-1]
    assert (refused["type"], refused["code"], refused["id"]) == ("error", "overloaded", "b2")
    assert "storage is full" in refused["message"]
    assert http_get(keyed.url + "/healthz")[0] == 200 and client.ping()["type"] == "pong"
    stored = json.loads(http_get(f"{keyed.url}/api/conversations/{conv}", headers={"Cookie": cookie})[2])
    assert [m["content"] for m in stored["messages"]][0] == "before the disk filled"
    assert [m["status"] for m in stored["messages"]] == ["complete", "complete"]
    with db_of(keyed) as db:
        db.execute("DELETE FROM messages WHERE conversation_id = ?", (filler,))
        db.execute("DELETE FROM conversations WHERE id = ?", (filler,))
    assert client.chat("hello " * 700, rid="b3", conversation_id=conv, params=SHORT)[-1]["type"] == "done"
    client.close()


# ---- 3. identity

def test_non_ascii_cookie_signature_is_refused_not_a_crash(keyed):
    forged = {"Cookie": "chat_client=" + VICTIM + ".\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9"}
    assert http_get(keyed.url + "/", headers=forged)[0] == 200
    status, _, body = http_get(keyed.url + "/api/conversations", headers=forged)
    assert status == 200 and json.loads(body) == []
    assert handshake_status(keyed.ws_url, cookie=forged["Cookie"].split(": ")[-1]) == 401
    assert handshake_status(keyed.ws_url, cookie="chat_client=" + VICTIM + "." + "A" * 24) == 401
    assert http_get(keyed.url + "/healthz")[0] == 200


def test_key_holders_cannot_name_a_browsers_identity(keyed):
    cookie = page_cookie(keyed)  # the victim's browser: chat_client=<id>.<signature>
    victim_id = cookie.split("=", 1)[1].split(".")[0]
    browser = WS(keyed.ws_url, cookie=cookie)
    conv = conv_of(browser.chat("my secret plans", params=SHORT))
    browser.close()
    bearer = {"Authorization": f"Bearer {KEY}", "Cookie": f"chat_client={victim_id}"}
    program = WS(keyed.ws_url, header=[f"{k}: {v}" for k, v in bearer.items()])
    refused = program.chat("show me", conversation_id=conv, params=SHORT)[-1]
    assert (refused["type"], refused["code"]) == ("error", "not_found")
    assert json.loads(http_get(keyed.url + "/api/conversations", headers=bearer)[2]) == []
    assert http_get(f"{keyed.url}/api/conversations/{conv}", headers=bearer)[0] == 404
    own = conv_of(program.chat("a program's own conversation", rid="own", params=SHORT))
    program.close()
    again = WS(keyed.ws_url, header=[f"{k}: {v}" for k, v in bearer.items()])  # its namespace lasts
    assert again.chat("and again", rid="own2", conversation_id=own, params=SHORT)[-1]["type"] == "done"
    again.close()


def test_host_prefixed_cookie_over_https_ignores_a_planted_one(keyed):
    https = {"X-Forwarded-Proto": "https"}
    cookie = http_get(keyed.url + "/", headers=https)[1]["Set-Cookie"]
    assert cookie.startswith("__Host-chat_client=") and "Secure" in cookie and "Path=/" in cookie
    assert "Domain" not in cookie
    planted = page_cookie(keyed)  # valid, signed, but plain-named: a sibling subdomain could set it
    attacker = WS(keyed.ws_url, cookie=planted)
    attacker.chat("bait", params=SHORT)
    attacker.close()
    status, headers, _ = http_get(keyed.url + "/", headers={**https, "Cookie": planted})
    assert status == 200 and headers["Set-Cookie"].startswith("__Host-chat_client=")  # a fresh identity
    assert json.loads(http_get(keyed.url + "/api/conversations", headers={**https, "Cookie": planted})[2]) == []
    host_cookie = "__Host-" + planted
    assert len(json.loads(http_get(keyed.url + "/api/conversations",
                                   headers={**https, "Cookie": host_cookie})[2])) == 1


# ---- 4. odd input

def test_deeply_nested_bodies_get_400_json(server):
    nested = b"[" * 100_000
    status, headers, body = http("POST", server.url + "/v1/chat/completions", nested,
                                 {"Content-Type": "application/json"})
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "invalid_json" and b"Traceback" not in body
    cookie = page_cookie(server)
    status, _, body = http("PATCH", f"{server.url}/api/conversations/{uuid.uuid4().hex}",
                           b'{"title": ' + nested, {"Content-Type": "application/json", "Cookie": cookie})
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_message"
    client = WS(server.ws_url)
    client.send('{"type": "chat", "id": "deep", "content": ' + "[" * 100_000)
    assert client.recv()["code"] in ("bad_json",)
    assert client.ping()["type"] == "pong" and http_get(server.url + "/healthz")[0] == 200
    client.close()


@pytest.mark.parametrize("rid", ["a\n", "a\r\n", "\na", "a b"])
def test_ids_are_matched_whole(ws, rid):
    ws.send({"type": "chat", "id": rid, "content": "hi", "params": SHORT})
    error = ws.recv()
    assert (error["type"], error["code"]) == ("error", "bad_message") and "id" not in error


# ---- 5. nothing internal leaked

def test_key_never_in_the_url_or_the_logs(keyed):
    ws = websocket.create_connection(keyed.ws_url, subprotocols=["chat.v1", f"bearer.{KEY}"], timeout=10)
    assert json.loads(ws.recv())["type"] == "ready" and ws.subprotocol == "chat.v1"
    ws.close()
    assert handshake_status(keyed.ws_url, subprotocols=["chat.v1", "bearer.wrong"]) == 401
    assert handshake_status(keyed.ws_url + f"?token={KEY}") == 101  # still accepted, never logged
    assert http_get(keyed.url + f"/healthz?a=1&token={KEY}")[0] == 200
    http_get(keyed.url + "/healthz?after=1")
    deadline = time.monotonic() + 10
    while "/healthz?after=1" not in keyed.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = keyed.log_path.read_text(errors="replace")
    assert "token=[redacted]" in log and KEY not in log


# ---- 6. origin

def test_origin_must_match_the_scheme(keyed):
    host = f"127.0.0.1:{keyed.port}"
    https = ["X-Forwarded-Proto: https", f"Authorization: Bearer {KEY}"]
    assert handshake_status(keyed.ws_url, header=https, origin=f"http://{host}") == 403
    assert handshake_status(keyed.ws_url, header=https, origin=f"https://{host}") == 101
    plain = [f"Authorization: Bearer {KEY}"]
    assert handshake_status(keyed.ws_url, header=plain, origin=f"https://{host}") == 403
    csp = http_get(keyed.url + "/")[1]["Content-Security-Policy"]
    assert "connect-src 'self';" in csp and "ws:" not in csp


# ---- 8. behind a proxy that is not trusted

def test_forwarded_for_while_untrusted_is_warned_about_once(server):
    for _ in range(3):
        assert http_get(server.url + "/healthz", headers={"X-Forwarded-For": "203.0.113.9"})[0] == 200
    time.sleep(0.5)
    assert server.log_path.read_text().count("X-Forwarded-For while CHAT_TRUSTED_PROXIES=0") == 1


# ---- 1. limits a new identity cannot reset

@pytest.fixture(scope="module")
def limited(server_factory):
    """Tight limits; each test speaks from its own address through a trusted proxy header."""
    return server_factory("limited", CHAT_TRUSTED_PROXIES=1, CHAT_RATE_LIMIT_PER_MIN=3,
                          CHAT_RATE_LIMIT_PER_IP_PER_MIN=6, CHAT_MAX_ACTIVE_PER_CONNECTION=2,
                          CHAT_MAX_ACTIVE_PER_IP=3, CHAT_RESUME_GRACE_S=5, CHAT_MAX_NEW_TOKENS=4000)


def outcome(client, rid, **fields) -> str:
    """'done', or the error code that refused the chat."""
    last = client.chat("hi", rid=rid, **fields)[-1]
    return "done" if last["type"] == "done" else last["code"]


def test_reconnecting_without_a_cookie_does_not_reset_the_rate(limited):
    results = []
    for i in range(5):
        client = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.1"])
        results.append(outcome(client, f"r{i}", params=SHORT))
        client.close()
    assert results == ["done"] * 3 + ["rate_limited"] * 2


def test_fresh_cookies_share_their_address_rate(limited):
    results = []
    for i in range(8):
        client = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.2"], cookie=page_cookie(limited))
        results.append(outcome(client, f"c{i}", params=SHORT))
        client.close()
    assert results == ["done"] * 6 + ["rate_limited"] * 2
    other = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.99"])
    assert outcome(other, "x", params=SHORT) == "done"
    other.close()


def test_answers_outliving_their_socket_still_count(limited):
    long = {"max_new_tokens": 4000}
    cookie = page_cookie(limited)
    first = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.3"], cookie=cookie)
    for rid in ("a1", "a2"):
        first.send({"type": "chat", "id": rid, "content": "go", "params": long})
        first.until(lambda f, rid=rid: f.get("id") == rid and f["type"] in ("start", "delta"))
    first.conn.sock.close()  # dropped: both answers run on for the resume grace
    again = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.3"], cookie=cookie)
    assert outcome(again, "a3", params=long) == "busy"  # per client, not per connection
    again.close()
    codes = []
    for i in range(3):  # cookie-less connections: new clients, one address
        client = WS(limited.ws_url, header=["X-Forwarded-For: 192.0.2.3"])
        client.send({"type": "chat", "id": f"n{i}", "content": "go", "params": long})
        codes.append(client.until(lambda f: f["type"] in ("start", "error"))[-1].get("code", "started"))
        client.conn.sock.close()
    assert codes == ["started", "busy", "busy"]  # 2 + 1 = the address's 3
    assert http_get(limited.url + "/healthz")[0] == 200


# ---- 7. a client that stops reading

def test_a_client_that_stops_reading_is_dropped_and_its_answer_released(server_factory):
    srv = server_factory("slow", CHAT_SEND_TIMEOUT_S=1, CHAT_RESUME_GRACE_S=1, CHAT_MAX_NEW_TOKENS=4000)
    cookie = page_cookie(srv)
    slow = WS(srv.ws_url, cookie=cookie, sockopt=((socket.SOL_SOCKET, socket.SO_RCVBUF, 4096),))
    slow.send({"type": "chat", "id": "pinned", "content": "go", "params": {"max_new_tokens": 4000}})
    conv = conv_of(slow.until(lambda f: f["type"] == "start"))
    slow.conn.settimeout(5)
    for _ in range(100):  # pongs echo 60 kB each and nobody reads them
        try:
            slow.send({"type": "ping", "t": "x" * 60_000})
        except (OSError, websocket.WebSocketException):
            break  # the server gave up on this socket
    deadline = time.monotonic() + 60
    while "stopped reading" not in srv.log():
        assert time.monotonic() < deadline, "the stalled socket was never dropped"
        time.sleep(0.2)
    polite = WS(srv.ws_url, cookie=cookie)  # after the grace the conversation is free again
    while True:
        last = polite.chat("my turn", rid=f"p{int(time.monotonic() * 1000)}", conversation_id=conv,
                           params=SHORT)[-1]
        if last["type"] == "done" or time.monotonic() > deadline:
            break
        assert last["code"] == "busy"
        time.sleep(0.5)
    assert last["type"] == "done"
    stored = json.loads(http_get(f"{srv.url}/api/conversations/{conv}", headers={"Cookie": cookie})[2])
    assert stored["messages"][1]["reason"] == "cancelled" and stored["messages"][1]["status"] == "partial"
    polite.close()
    slow.close()
