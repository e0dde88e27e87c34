"""Conversations over the socket, in-process: resume after drops, regenerate, isolation."""
from __future__ import annotations

import json

import pytest
from helpers import (
    WS,
    conv_of,
    cookie_for,
    finished_answer_resumes,
    http_get,
    in_threads,
    one_of_two_sockets_leaves,
    resume_after_forced_drops,
    text_of,
    two_sockets_follow_one_answer,
    wait_settled,
)


@pytest.fixture(scope="module")
def server(app_server):
    """The in-process app; restarts and signals are end to end, in test_e2e.py."""
    return app_server

LONG = {"temperature": 0.8, "seed": 5, "max_new_tokens": 4000}


def test_resume_after_forced_drops_loses_and_repeats_nothing(server):
    resume_after_forced_drops(server)


def test_finished_answer_is_resumable_within_grace(server):
    finished_answer_resumes(server)


def test_two_sockets_of_one_client_follow_one_answer(server):
    two_sockets_follow_one_answer(server)


def test_one_of_two_sockets_leaving_does_not_end_the_answer(server):
    one_of_two_sockets_leaves(server)


def test_regenerate_replaces_the_last_answer(server):
    cookie = cookie_for(server)
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
    owner_cookie, other_cookie = cookie_for(server), cookie_for(server)
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
    cookie = cookie_for(server)
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
