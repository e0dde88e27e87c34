"""AppState.shutdown in process: no new turns, running answers end with ``shutdown`` and are stored
as partial, sockets close with 1001; close() then releases the store. (SIGTERM under gunicorn: test_e2e.)"""
from __future__ import annotations

import json
import sqlite3
import threading

import pytest
import websocket
from fakes import FakeEngine
from helpers import WS, conv_of, conversation, cookie_for, http_get, text_of


def test_shutdown_ends_answers_in_order_then_close_releases_the_store(app_factory):
    srv = app_factory(FakeEngine(answer_words=100_000, delay=0.002))
    cookie = cookie_for(srv)
    client = WS(srv.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "L", "content": "long", "params": {"max_new_tokens": 4000}})
    frames = client.until(lambda f: f["type"] == "delta")
    conv = conv_of(frames)
    stopper = threading.Thread(target=srv.state.shutdown, args=(0.3,))
    stopper.start()
    frames += client.until(lambda f: f["type"] == "done")
    assert frames[-1]["reason"] == "shutdown"
    kinds = [f["type"] for f in frames]
    # The client hears first that the server drains (not "at capacity"), while the answer still streams.
    assert kinds.count("draining") == 1 and "delta" in kinds[kinds.index("draining") + 1:], kinds
    status, _, body = http_get(srv.url + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok", "model": "draining"}
    opcode, frame = client.conn.recv_data_frame(control_frame=True)
    assert opcode == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(frame.data[:2], "big") == 1001
    stopper.join(30)
    assert not stopper.is_alive()
    srv.state.shutdown(0.3)  # a second call does nothing
    late_client = WS(srv.ws_url, cookie=cookie)
    assert late_client.ready["draining"] is True  # a socket accepted while stopping hears it in `ready`
    late = late_client.chat("late", rid="late")[-1]
    assert (late["type"], late["code"]) == ("error", "overloaded")  # no new turns
    stored = conversation(srv, cookie, conv)[1]["messages"][-1]
    assert stored["status"] == "partial" and stored["reason"] == "shutdown"
    assert stored["content"] == text_of(frames)
    srv.state.close()
    with pytest.raises(sqlite3.ProgrammingError):  # closed
        srv.state.store.list_conversations("a-client-0123456789")


@pytest.mark.parametrize("engine, said", [
    (FakeEngine(ready=False), {"status": "ok", "model": "loading"}),
    (FakeEngine(), {"status": "ok", "model": "ready", "name": "fake-model"}),
])
def test_healthz_says_what_readyz_would_without_a_failure(app_factory, engine, said):
    srv = app_factory(engine)
    status, _, body = http_get(srv.url + "/healthz")
    assert status == 200 and json.loads(body) == said
    assert http_get(srv.url + "/readyz")[0] == (200 if engine.ready else 503)
