"""chat.v1 as protocol.md states it, over a real socket to the app served in-process (fake engine)."""
from __future__ import annotations

import json
import time

import pytest
import websocket
from fakes import FakeEngine
from helpers import WS, chat_streams_and_stores_the_answer, conv_of, cookie_for, http_get, in_threads, start_of, text_of

GREEDY = {"temperature": 0, "max_new_tokens": 40}
LONG_ANSWERS = dict(answer_words=100_000, delay=0.001)


@pytest.fixture(scope="module")
def server(app_server):
    """Every test here talks to the in-process app; end-to-end runs live in test_e2e.py."""
    return app_server


def test_ready_frame(ws):
    ready = ws.ready
    assert ready["protocol"] == "chat.v1"
    assert ready["model"]
    assert set(ready["limits"]) == {"max_content_chars", "max_new_tokens", "context_tokens",
                                    "max_active_per_connection", "trash_days"}


def test_chat_streams_and_stores_the_answer(server):
    chat_streams_and_stores_the_answer(server)


def test_greedy_answer_is_deterministic_and_multi_turn(ws):
    first = ws.chat("Same question", rid="a", params=GREEDY)
    again = ws.chat("Same question", rid="b", params=GREEDY)
    assert text_of(first) == text_of(again)
    conv = conv_of(first)
    follow = ws.chat("And then?", rid="c", conversation_id=conv, params=GREEDY)
    assert conv_of(follow) == conv
    assert follow[-1]["usage"]["prompt_tokens"] > first[-1]["usage"]["prompt_tokens"]


def test_seeded_sampling_reproduces(ws):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 30}
    assert text_of(ws.chat("Tell me something", rid="s1", params=params)) == \
        text_of(ws.chat("Tell me something", rid="s2", params=params))


BAD_INPUTS = [
    ("not json", "bad_json"),
    ('{"type": "chat", "id": "x", "content": "hi"', "bad_json"),
    (b"\x00\x01binary", "bad_message"),
    ("[1, 2]", "bad_message"),
    ('"just a string"', "bad_message"),
    ("{}", "bad_message"),
    ('{"type": 5}', "bad_message"),
    ('{"type": "dance"}', "unknown_type"),
    ('{"type": "chat", "content": "hi"}', "bad_message"),
    ('{"type": "chat", "id": "bad id!", "content": "hi"}', "bad_message"),
    ('{"type": "chat", "id": "' + "x" * 65 + '", "content": "hi"}', "bad_message"),
    ('{"type": "chat", "id": "a"}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": ""}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "   "}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": 42}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": 3}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"temperature": 2.5}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"temperature": "hot"}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"top_p": 0}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"top_p": 1.5}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"max_new_tokens": 0}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"max_new_tokens": 99999999}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"seed": 1.5}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"top_k": -1}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"top_k": 2.5}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"min_p": 1.5}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "params": {"enable_thinking": "yes"}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "conversation_id": 7}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "model": 7}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "model": ""}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "model": "not-served-here"}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "model": "not-served", "conversation_id": "nope"}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "conversation_id": "nope"}', "not_found"),
    ('{"type": "chat", "id": "a", "content": "hi", "conversation_id": "0123456789abcdef0123456789abcdef"}',
     "not_found"),
    ('{"type": "regenerate", "id": "a", "conversation_id": "0123456789abcdef0123456789abcdef"}', "not_found"),
    ('{"type": "regenerate", "id": "a"}', "bad_message"),
    ('{"type": "cancel"}', "bad_message"),
    ('{"type": "cancel", "id": "never-seen"}', "unknown_id"),
    ('{"type": "resume", "id": "never-seen", "from": 0}', "unknown_id"),
    ('{"type": "resume", "id": "a", "from": -1}', "bad_message"),
    ('{"type": "resume", "id": "a"}', "bad_message"),
]


@pytest.mark.parametrize("raw,code", BAD_INPUTS)
def test_bad_input_gets_its_error_and_the_connection_lives(ws, raw, code):
    ws.send(raw)
    error = ws.recv()
    assert error["type"] == "error" and error["code"] == code, error
    assert error["message"]
    assert ws.ping() == {"type": "pong", "t": 7}


def test_error_carries_the_request_id(ws):
    ws.send({"type": "chat", "id": "with-id", "content": "hi", "params": {"top_p": 7}})
    error = ws.recv()
    assert error["id"] == "with-id" and "top_p" in error["message"]


def test_too_large_content(ws):
    limit = ws.ready["limits"]["max_content_chars"]
    ws.send({"type": "chat", "id": "big", "content": "x" * (limit + 1)})
    error = ws.recv()
    assert (error["code"], error["id"]) == ("too_large", "big")
    assert ws.ping()["type"] == "pong"


def test_cancel_ends_the_stream_promptly(ws):
    ws.send({"type": "chat", "id": "long", "content": "go", "params": {"max_new_tokens": 4000}})
    ws.until(lambda f: f["type"] == "delta")
    ws.send({"type": "cancel", "id": "long"})
    frames = ws.until(lambda f: f["type"] == "done")
    assert frames[-1]["reason"] == "cancelled"
    assert frames[-1]["usage"]["completion_tokens"] < 4000
    # cancelling a finished id is a no-op, not an error
    ws.send({"type": "cancel", "id": "long"})
    assert ws.ping()["type"] == "pong"


def test_duplicate_id_and_busy_conversation(ws):
    first = ws.chat("hi", rid="d0", params=GREEDY)
    conv = conv_of(first)
    ws.send({"type": "chat", "id": "d1", "content": "long", "conversation_id": conv,
             "params": {"max_new_tokens": 4000}})
    ws.until(lambda f: f["type"] == "start")
    ws.send({"type": "chat", "id": "d1", "content": "again"})
    dup = ws.until(lambda f: f["type"] == "error")[-1]
    assert (dup["code"], dup["id"]) == ("duplicate_id", "d1")
    ws.send({"type": "chat", "id": "d2", "content": "same conversation", "conversation_id": conv})
    busy = ws.until(lambda f: f["type"] == "error")[-1]
    assert (busy["code"], busy["id"]) == ("busy", "d2")
    ws.send({"type": "cancel", "id": "d1"})
    assert ws.until(lambda f: f["type"] == "done")[-1]["id"] == "d1"


def test_stop_cancels_everything_then_closes(server):
    client = WS(server.ws_url)
    for rid in ("p1", "p2"):
        client.send({"type": "chat", "id": rid, "content": "go", "params": {"max_new_tokens": 4000}})
    client.until(lambda f: f["type"] == "delta")
    client.send({"type": "stop"})
    done, close_code = {}, None
    while close_code is None:
        opcode, data = client.conn.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            close_code = int.from_bytes(data[:2], "big")
        elif opcode == websocket.ABNF.OPCODE_TEXT and json.loads(data)["type"] == "done":
            frame = json.loads(data)
            done[frame["id"]] = frame["reason"]
    assert done == {"p1": "cancelled", "p2": "cancelled"}
    assert close_code == 1000  # the server ended the connection normally
    # nothing more comes: the socket ends (werkzeug's dev server writes its HTTP epilogue first)
    with pytest.raises((websocket.WebSocketConnectionClosedException, websocket.WebSocketProtocolException)):
        client.conn.recv()


def test_unicode_round_trips_exactly(server):
    cookie = cookie_for(server)
    client = WS(server.ws_url, cookie=cookie)
    content = "你好，世界！用中文回答。😀🎉 👩‍👩‍👧 café"
    frames = client.chat(content, params={"temperature": 1.0, "seed": 3, "max_new_tokens": 200})
    answer = text_of(frames)
    conv = conv_of(frames)
    stored = json.loads(http_get(f"{server.url}/api/conversations/{conv}", headers={"Cookie": cookie})[2])
    assert stored["messages"][0]["content"] == content
    assert stored["messages"][1]["content"] == answer
    client.close()


def test_dropped_socket_cancels_after_grace_and_keeps_partial(server):
    cookie = cookie_for(server)
    client = WS(server.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "drop", "content": "go", "params": {"max_new_tokens": 4000}})
    frames = client.until(lambda f: f["type"] == "delta" and f["index"] >= 5)
    conv = conv_of(frames)
    client.conn.sock.close()  # abrupt: no close frame
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        messages = json.loads(http_get(f"{server.url}/api/conversations/{conv}",
                                       headers={"Cookie": cookie})[2])["messages"]
        if messages[-1]["status"] != "streaming":
            break
        time.sleep(0.2)
    answer = messages[-1]
    assert answer["reason"] == "cancelled" and answer["status"] == "partial"
    assert answer["content"].startswith(text_of(frames)) and answer["usage"]["completion_tokens"] < 4000


def test_many_connections_stream_at_once(server):
    results = {}

    def one(i):
        client = WS(server.ws_url)
        results[i] = client.chat(f"question {i}", rid=f"m{i}", params={"temperature": 0.7, "max_new_tokens": 60})
        client.close()

    in_threads(one, 6, timeout=60)
    assert len(results) == 6
    assert all(r[-1]["type"] == "done" and r[-1]["reason"] == "length" for r in results.values())


def test_queued_positions_then_overloaded(app_factory):
    srv = app_factory(FakeEngine(slots=1, max_queue=1, **LONG_ANSWERS))
    first, second, third = WS(srv.ws_url), WS(srv.ws_url), WS(srv.ws_url)
    first.send({"type": "chat", "id": "q1", "content": "long", "params": {"max_new_tokens": 4000}})
    first.until(lambda f: f["type"] == "delta")
    second.send({"type": "chat", "id": "q2", "content": "waits", "params": {"max_new_tokens": 5}})
    assert second.recv() == {"type": "queued", "id": "q2", "position": 1}
    third.send({"type": "chat", "id": "q3", "content": "too many"})
    refused = third.recv()
    assert (refused["type"], refused["code"], refused["id"]) == ("error", "overloaded", "q3")
    first.send({"type": "cancel", "id": "q1"})
    assert first.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    frames = second.until(lambda f: f["type"] == "done")
    assert start_of(frames) and frames[-1]["reason"] == "length"
    for client in (first, second, third):
        client.close()


def test_generation_time_limit(app_factory):
    srv = app_factory(FakeEngine(timeout_s=0.5, **LONG_ANSWERS), max_new_tokens=30000, context_tokens=32768)
    client = WS(srv.ws_url)
    frames = client.chat("forever", params={"max_new_tokens": 30000})
    client.close()
    assert frames[-1]["reason"] == "timeout" and frames[-1]["usage"]["completion_tokens"] < 30000
    assert text_of(frames)


PRECEDENCE = [
    # (frame, the code that wins): each frame breaks several rules at once
    ('{"type": "dance", "id": "bad id!"', "bad_json"),
    ('{"type": "chat", "id": "a", "content": "TOO-LARGE", "params": {"temperature": 9}}', "bad_message"),
    ('{"type": "chat", "id": "a", "content": "hi", "conversation_id": "nope", "params": {"top_p": 0}}',
     "bad_message"),
    ('{"type": "dance", "content": "TOO-LARGE"}', "unknown_type"),
    ('{"type": "chat", "id": "L1", "content": "TOO-LARGE"}', "too_large"),
    ('{"type": "chat", "id": "L1", "content": "hi", "conversation_id": "0123456789abcdef0123456789abcdef"}',
     "duplicate_id"),
    ('{"type": "chat", "id": "n1", "content": "hi", "conversation_id": "0123456789abcdef0123456789abcdef"}',
     "not_found"),
    ('{"type": "chat", "id": "b1", "content": "hi", "conversation_id": "BUSY"}', "busy"),
]


def test_error_precedence_the_first_rule_in_the_order_wins(app_factory):
    srv = app_factory(FakeEngine(slots=1, max_queue=0, **LONG_ANSWERS), max_active_per_connection=1,
                      rate_limit_per_ip_per_min=2)
    first = WS(srv.ws_url, cookie=cookie_for(srv))
    limit = first.ready["limits"]["max_content_chars"]
    first.send({"type": "chat", "id": "L1", "content": "long"})  # takes the engine, the client's slot
    conv = conv_of(first.until(lambda f: f["type"] == "start"))  # and the first of the address's two tokens
    for raw, code in PRECEDENCE:
        first.send(raw.replace("TOO-LARGE", "x" * (limit + 1)).replace("BUSY", conv))
        error = first.until(lambda f: f["type"] == "error")[-1]
        assert error["code"] == code, (raw[:80], error)
    second = WS(srv.ws_url, cookie=cookie_for(srv))  # another client: its own slot, the address's rate
    assert second.chat("engine full", rid="o1")[-1]["code"] == "overloaded"  # spends the second token
    first.send({"type": "chat", "id": "o2", "content": "busy conversation", "conversation_id": conv})
    assert first.until(lambda f: f["type"] == "error")[-1]["code"] == "busy"  # busy before the rate
    assert second.chat("both", rid="o3")[-1]["code"] == "rate_limited"  # over rate and over capacity
    first.send({"type": "cancel", "id": "L1"})
    assert first.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    for client in (first, second):
        client.close()


def test_delta_frames_written_directly_are_what_json_and_wsproto_write():
    from wsproto.connection import Connection, ConnectionType
    from wsproto.events import TextMessage

    from chat.web.internals import text_frame
    from chat.web.ws import encode
    for text in ["", "plain", 'quo"te\\ and \n', "ünï\u2028code 😀", "\x00\x1f\x7f", "x" * 120, "y" * 70_000]:
        for frame in ({"type": "delta", "id": "r-1", "index": 7, "text": text},
                      {"type": "delta", "id": "r-1", "index": 7, "text": text, "tokens": 12}):
            assert encode(frame) == json.dumps(frame, ensure_ascii=False)
            assert text_frame(encode(frame)) == Connection(ConnectionType.SERVER).send(TextMessage(data=encode(frame)))
    done = {"type": "done", "id": "r-1", "reason": "stop", "usage": {"prompt_tokens": 1}, "timings": {}}
    assert encode(done) == json.dumps(done, ensure_ascii=False)


# ---------------------------------------------------------------- a thinking model (protocol.md, "Thinking")

# the last thinking and the first answer in one piece: the engine's one delta becomes two frames
THINKING_WORDS = ["<", "think", ">\nHm", ", two", " and two.\n</think>\n\nFour", "."]


def test_a_thinking_models_thinking_comes_on_delta_frames_of_its_own(app_factory):
    srv = app_factory(FakeEngine(words=THINKING_WORDS, thinking=True, delay=0.002))
    ws = WS(srv.ws_url)
    try:
        frames = ws.chat("2+2?", params={"enable_thinking": True})
        deltas = [f for f in frames if f["type"] == "delta"]
        assert "".join(f.get("reasoning", "") for f in deltas) == "Hm, two and two."
        assert text_of(frames) == "Four."
        assert all(f["text"] == "" for f in deltas if f.get("reasoning"))
        assert frames[-1]["timings"]["thinking_ms"] >= 0
        assert srv.state.engine.history[-1].params.enable_thinking is True
        other = WS(srv.ws_url)  # the fake engine does not say it thinks: no switch offered
        assert "thinking" not in other.ready
        other.close()
    finally:
        ws.close()
