"""Conversations over the socket: resume after drops, regenerate, isolation, restarts."""
from __future__ import annotations

import json
import signal
import time

from conftest import WS, conv_of, http_get, in_threads, text_of

LONG = {"temperature": 0.8, "seed": 5, "max_new_tokens": 4000}


def new_cookie(server) -> str:
    return http_get(server.url + "/")[1]["Set-Cookie"].split(";")[0]


def conversation(server, cookie, conv):
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


def test_resume_after_forced_drops_loses_and_repeats_nothing(server):
    cookie = new_cookie(server)
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
        client = WS(server.ws_url, cookie=cookie)
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


def test_finished_answer_is_resumable_within_grace(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    frames = client.chat("short", rid="fin", params={"temperature": 0, "max_new_tokens": 15})
    client.close()
    again = WS(server.ws_url, cookie=cookie)
    again.send({"type": "resume", "id": "fin", "from": 3})
    replay = again.until(lambda f: f["type"] == "done")
    deltas = sum(1 for f in frames if f["type"] == "delta")
    assert [f["index"] for f in replay[:-1]] == list(range(3, deltas))
    assert "".join(f["text"] for f in replay[:-1]) == text_of(frames)[len("".join(
        f["text"] for f in frames if f["type"] == "delta" and f["index"] < 3)):]
    again.close()


def test_regenerate_replaces_the_last_answer(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    first = client.chat("pick a word", rid="g1", params={"temperature": 1.0, "seed": 1, "max_new_tokens": 20})
    conv = conv_of(first)
    client.send({"type": "regenerate", "id": "g2", "conversation_id": conv,
                 "params": {"temperature": 1.0, "seed": 2, "max_new_tokens": 20}})
    second = client.until(lambda f: f["type"] == "done")
    client.close()
    messages = wait_settled(server, cookie, conv)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == text_of(second) != text_of(first)


def test_another_client_can_touch_nothing(server):
    owner_cookie, other_cookie = new_cookie(server), new_cookie(server)
    owner = WS(server.ws_url, cookie=owner_cookie)
    owner.send({"type": "chat", "id": "mine", "content": "secret", "params": LONG})
    conv = owner.until(lambda f: f["type"] == "start")[-1]["conversation_id"]
    other = WS(server.ws_url, cookie=other_cookie)
    for frame, code in [
        ({"type": "chat", "id": "x1", "content": "hi", "conversation_id": conv}, "not_found"),
        ({"type": "regenerate", "id": "x2", "conversation_id": conv}, "not_found"),
        ({"type": "cancel", "id": "mine"}, "unknown_id"),
        ({"type": "resume", "id": "mine", "from": 0}, "unknown_id"),
    ]:
        other.send(frame)
        error = other.until(lambda f: f["type"] == "error")[-1]
        assert error["code"] == code, (frame, error)
    for method, suffix in [("GET", ""), ("PATCH", ""), ("DELETE", ""), ("GET", "/export?format=json"),
                           ("GET", "/export?format=md")]:
        import urllib.request
        req = urllib.request.Request(f"{server.url}/api/conversations/{conv}{suffix}", method=method,
                                     headers={"Cookie": other_cookie, "Content-Type": "application/json"},
                                     data=b'{"title": "stolen"}' if method == "PATCH" else None)
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError(f"{method} {suffix} succeeded for another client")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404 and json.loads(exc.read())["error"]["code"] == "not_found"
    assert conv not in [c["id"] for c in json.loads(http_get(server.url + "/api/conversations",
                                                             headers={"Cookie": other_cookie})[2])]
    owner.send({"type": "cancel", "id": "mine"})
    assert owner.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    owner.close()
    other.close()


def test_eight_concurrent_streams_store_without_errors(server):
    cookie = new_cookie(server)
    done = {}

    def one(i):
        client = WS(server.ws_url, cookie=cookie)
        frames = client.chat(f"stream {i}", rid=f"c{i}", params={"temperature": 0.7, "max_new_tokens": 80})
        done[i] = (conv_of(frames), text_of(frames), frames[-1])
        client.close()

    in_threads(one, 8, timeout=90)
    assert len(done) == 8
    for conv, text, last in done.values():
        assert last["type"] == "done", last
        assert wait_settled(server, cookie, conv)["messages"][-1]["content"] == text


def test_conversations_survive_restart_and_a_kill_mid_answer(server_factory):
    srv = server_factory("restart", CHAT_MAX_NEW_TOKENS=4000)
    cookie = new_cookie(srv)
    client = WS(srv.ws_url, cookie=cookie)
    frames = client.chat("remember me", rid="k1", params={"temperature": 0, "max_new_tokens": 20})
    conv = conv_of(frames)
    client.close()
    assert srv.stop(signal.SIGTERM) == 0
    srv.start()
    status, data = conversation(srv, cookie, conv)
    assert status == 200 and [m["content"] for m in data["messages"]] == ["remember me", text_of(frames)]
    # a kill -9 in the middle of an answer leaves the partial text, marked interrupted
    client = WS(srv.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "k2", "content": "long", "conversation_id": conv, "params": LONG})
    client.until(lambda f: f["type"] == "delta" and f["index"] >= 10)
    time.sleep(1.5)  # past one checkpoint
    srv.stop(signal.SIGKILL)
    srv.start()
    last = conversation(srv, cookie, conv)[1]["messages"][-1]
    assert last["status"] == "interrupted" and last["content"]
    client = WS(srv.ws_url, cookie=cookie)
    follow = client.chat("still there?", rid="k3", conversation_id=conv, params={"max_new_tokens": 10})
    assert follow[-1]["type"] == "done"
    client.close()


def test_sigterm_finishes_short_answers_and_stores_long_ones(server_factory):
    srv = server_factory("term", CHAT_MAX_NEW_TOKENS=30000, CHAT_CONTEXT_TOKENS=32768,
                         CHAT_GRACEFUL_TIMEOUT_S=6)
    cookie = new_cookie(srv)
    long_client, short_client = WS(srv.ws_url, cookie=cookie), WS(srv.ws_url, cookie=cookie)
    long_client.send({"type": "chat", "id": "L", "content": "long", "params": {"max_new_tokens": 30000}})
    conv = conv_of(long_client.until(lambda f: f["type"] == "delta"))
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    short_client.send({"type": "chat", "id": "S", "content": "late"})
    refused = short_client.until(lambda f: f["type"] in ("error", "done"))[-1]
    assert refused["type"] == "error" and refused["code"] == "overloaded"
    frames = long_client.until(lambda f: f["type"] == "done")
    assert frames[-1]["reason"] == "shutdown"
    assert srv.proc.wait(30) == 0
    assert "Traceback" not in srv.log()
    srv.start()
    last = conversation(srv, cookie, conv)[1]["messages"][-1]
    assert last["reason"] == "shutdown" and last["status"] == "partial" and last["content"]
