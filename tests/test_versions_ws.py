"""Versions over the socket: edit, regenerate and continue keep every branch; attachments; restarts.

In-process with the fake engine (what the model is sent is checked there), except the restart,
which runs the real gunicorn server with the tiny model.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from helpers import WS, conv_of, conversation, cookie_for, start_of, text_of, wait_settled

SHORT = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(app_server):
    return app_server


def new_cookie(server) -> str:
    return cookie_for(server)


def sent_to_model(server) -> list:
    """The messages of the engine's latest generation."""
    return server.state.engine.history[-1].messages


def http_post(server, path, body, cookie):
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Cookie": cookie, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(client, rid, **fields):
    """Send a request and return its frames up to its done or error."""
    client.send({"id": rid, **fields})
    return client.until(lambda f: f.get("id") == rid and f["type"] in ("done", "error"))


def error_of(frames) -> str:
    assert frames[-1]["type"] == "error", frames[-1]
    return frames[-1]["code"]


def test_edit_and_regenerate_keep_every_version(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    first = client.chat("first question", rid="e1", params=SHORT)
    conv = conv_of(first)
    client.chat("second question", rid="e2", conversation_id=conv, params=SHORT)
    u1, a1, u2, a2 = [m["id"] for m in wait_settled(server, cookie, conv)["messages"]]
    edited = ask(client, "e3", type="edit", conversation_id=conv, message_id=u2, content="second, edited",
                 params=SHORT)
    assert edited[-1]["type"] == "done"
    path = wait_settled(server, cookie, conv)["messages"]
    assert [m["content"] for m in path[:3]] == ["first question", text_of(first), "second, edited"]
    assert path[2]["versions"]["ids"][0] == u2 and path[2]["versions"]["count"] == 2
    assert path[3]["id"] == start_of(edited)["message_id"] and path[3]["content"] == text_of(edited)
    assert [m["content"] for m in sent_to_model(server)[1:]] == ["first question", text_of(first), "second, edited"]
    # regenerate an earlier answer: a new version beside it, the path below is on the old branch
    again = ask(client, "e4", type="regenerate", conversation_id=conv, message_id=a1,
                params={"temperature": 1.0, "seed": 3, "max_new_tokens": 8})
    path = wait_settled(server, cookie, conv)["messages"]
    assert [m["id"] for m in path] == [u1, start_of(again)["message_id"]]
    assert path[1]["versions"] == {"index": 1, "count": 2, "ids": [a1, path[1]["id"]]}
    # switching back restores the newest branch below the old answer
    status, back = http_post(server, f"/api/conversations/{conv}/active", {"message_id": a1}, cookie)
    assert status == 200 and [m["content"] for m in back["messages"]][2] == "second, edited"
    status, old = http_post(server, f"/api/conversations/{conv}/active", {"message_id": u2}, cookie)
    assert [m["id"] for m in old["messages"]] == [u1, a1, u2, a2]
    client.close()


def test_edit_and_regenerate_errors(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    conv = conv_of(client.chat("question", rid="x1", params=SHORT))
    u1, a1 = [m["id"] for m in wait_settled(server, cookie, conv)["messages"]]
    other = WS(server.ws_url, cookie=new_cookie(server))
    cases = [
        ({"type": "edit", "conversation_id": conv, "message_id": a1, "content": "x"}, "bad_message"),
        ({"type": "edit", "conversation_id": conv, "message_id": "0" * 32, "content": "x"}, "bad_message"),
        ({"type": "edit", "conversation_id": conv, "message_id": u1}, "bad_message"),
        ({"type": "edit", "conversation_id": conv, "message_id": u1, "content": "x" * 20000}, "too_large"),
        ({"type": "regenerate", "conversation_id": conv, "message_id": u1}, "bad_message"),
        ({"type": "continue", "conversation_id": "0" * 32}, "not_found"),
    ]
    for n, (frame, code) in enumerate(cases):
        got = ask(client, f"bad{n}", **frame)
        assert error_of(got) == code and got[-1]["id"] == f"bad{n}", (frame, got[-1])
    for n, frame in enumerate([{"type": "edit", "conversation_id": conv, "message_id": u1, "content": "x"},
                               {"type": "regenerate", "conversation_id": conv}]):
        assert error_of(ask(other, f"o{n}", **frame)) == "not_found"
    assert [m["id"] for m in wait_settled(server, cookie, conv)["messages"]] == [u1, a1]
    # while the conversation is answering: a bad target is still bad_message (it outranks busy)
    client.send({"type": "chat", "id": "long", "conversation_id": conv, "content": "go",
                 "params": {"max_new_tokens": 2000}})
    client.until(lambda f: f.get("id") == "long" and f["type"] == "delta")
    assert error_of(ask(client, "b1", type="edit", conversation_id=conv, message_id=a1, content="x")) == "bad_message"
    assert error_of(ask(client, "b2", type="edit", conversation_id=conv, message_id=u1, content="x")) == "busy"
    assert error_of(ask(client, "b3", type="continue", conversation_id=conv)) == "busy"
    client.send({"type": "cancel", "id": "long"})
    client.until(lambda f: f.get("id") == "long" and f["type"] == "done")
    client.close()
    other.close()


def test_continue_extends_the_answer_in_place(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    first = client.chat("tell me a long story", rid="c1", params=SHORT)
    assert first[-1]["reason"] == "length"
    conv = conv_of(first)
    more = ask(client, "c2", type="continue", conversation_id=conv, params=SHORT)
    assert start_of(more)["message_id"] == start_of(first)["message_id"]
    assert [f["index"] for f in more if f["type"] == "delta"][0] == 0
    assert more[-1]["type"] == "done" and more[-1]["usage"]["completion_tokens"] <= SHORT["max_new_tokens"]
    sent = sent_to_model(server)[-1]
    assert sent == {"role": "assistant", "content": text_of(first), "prefix": True}  # the turn left open
    messages = wait_settled(server, cookie, conv)["messages"]
    assert len(messages) == 2
    assert messages[1]["content"] == text_of(first) + text_of(more)
    assert messages[1]["versions"]["count"] == 1
    # done counts the new part; the stored answer's figures cover all of it
    new, old = more[-1]["usage"]["completion_tokens"], first[-1]["usage"]["completion_tokens"]
    assert messages[1]["usage"]["completion_tokens"] == old + new
    assert messages[1]["usage"]["prompt_tokens"] == first[-1]["usage"]["prompt_tokens"]
    assert messages[1]["timings"]["ttft_ms"] == first[-1]["timings"]["ttft_ms"]


def test_continue_refuses_a_finished_answer(server):
    cookie = new_cookie(server)
    status, body = http_post(server, "/api/conversations/import", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", "reason": "stop"}]}, cookie)
    assert status == 201
    client = WS(server.ws_url, cookie=cookie)
    assert error_of(ask(client, "s1", type="continue", conversation_id=body["id"])) == "bad_message"
    client.close()


def test_attachments_are_stored_and_limited(server):
    cookie = new_cookie(server)
    client = WS(server.ws_url, cookie=cookie)
    files = [{"name": "notes.txt", "text": "alpha\nbeta"}, {"name": "b.py", "text": "print(1)"}]
    frames = client.chat("read these", rid="f1", attachments=files, params=SHORT)
    conv = conv_of(frames)
    user = wait_settled(server, cookie, conv)["messages"][0]
    assert (user["content"], user["attachments"]) == ("read these", files)
    assert sent_to_model(server)[-1]["content"] == ("read these\n\nnotes.txt:\n```\nalpha\nbeta\n```"
                                                    "\n\nb.py:\n```\nprint(1)\n```")
    limit = client.ready["limits"]["max_content_chars"]
    over = [{"name": "big.txt", "text": "x" * limit}]
    assert error_of(client.chat("and this", rid="f2", attachments=over)) == "too_large"
    assert error_of(client.chat("many", rid="f3", attachments=[{"name": "a", "text": "b"}] * 9)) == "bad_message"
    assert error_of(client.chat("nameless", rid="f4", attachments=[{"name": "", "text": "b"}])) == "bad_message"
    # an edit keeps the files of the version it replaces
    ask(client, "f5", type="edit", conversation_id=conv, message_id=user["id"], content="read them again",
        params=SHORT)
    edited = wait_settled(server, cookie, conv)["messages"][0]
    assert edited["content"] == "read them again" and edited["attachments"] == files
    client.close()


def test_versions_branches_and_attachments_survive_a_restart(server_factory):
    srv = server_factory("versions-restart")
    cookie = new_cookie(srv)
    client = WS(srv.ws_url, cookie=cookie)
    conv = conv_of(client.chat("q", rid="r1", params=SHORT, attachments=[{"name": "f.txt", "text": "data"}]))
    u1, a1 = [m["id"] for m in wait_settled(srv, cookie, conv)["messages"]]
    ask(client, "r2", type="regenerate", conversation_id=conv, params={**SHORT, "temperature": 1.0, "seed": 9})
    ask(client, "r3", type="edit", conversation_id=conv, message_id=u1, content="q, edited", params=SHORT)
    wait_settled(srv, cookie, conv)
    client.close()
    before = [http_post(srv, f"/api/conversations/{conv}/active", {"message_id": m}, cookie)[1]
              for m in (a1, u1)]
    srv.restart()
    after = [http_post(srv, f"/api/conversations/{conv}/active", {"message_id": m}, cookie)[1] for m in (a1, u1)]
    assert after == before
    assert before[0]["messages"][0]["attachments"] == [{"name": "f.txt", "text": "data"}]
    assert before[0]["messages"][1]["versions"]["count"] == 2 and before[0]["messages"][0]["versions"]["count"] == 2
    assert conversation(srv, cookie, conv)[1]["messages"] == before[1]["messages"]
