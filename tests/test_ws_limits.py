"""One WebSocket message's bounds: a too-large frame gets its 1009 close delivered (lingering close),
a message in endless fragments is bounded in count and in time (issue 33, items 4 and 6)."""
from __future__ import annotations

import time

import pytest
import websocket
from helpers import WS


@pytest.fixture(scope="module")
def srv(app_factory):
    return app_factory(max_message_bytes=256 * 1024)


def close_code(conn) -> int | None:
    """The code of the close frame the server sent (None: the connection broke without one)."""
    try:
        while True:
            opcode, data = conn.recv_data(control_frame=True)
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                return int.from_bytes(data[:2], "big")
    except (OSError, websocket.WebSocketException):
        return None


@pytest.mark.parametrize("size", [300 * 1024, 2 * 1024 * 1024])
def test_a_too_large_frame_on_a_new_connection_gets_its_1009(srv, size):
    conn = websocket.create_connection(srv.ws_url, timeout=30)
    try:
        conn.recv()  # ready
        try:
            conn.send("x" * size)
        except OSError:
            pass  # the whole frame need not go: the close frame must still arrive
        assert close_code(conn) == 1009
    finally:
        conn.close()
    assert WS(srv.ws_url).ping()["type"] == "pong"


def test_a_too_large_frame_after_a_conversation_gets_its_1009(srv):
    client = WS(srv.ws_url)
    try:
        assert client.chat("hi", params={"max_new_tokens": 3})[-1]["type"] == "done"
        try:
            client.conn.send("y" * (2 * 1024 * 1024))
        except OSError:
            pass
        assert close_code(client.conn) == 1009
    finally:
        client.close()


def fragments(conn, count: int, pause: float = 0.0) -> None:
    """A text message begun and never finished: one frame, then ``count`` empty continuations."""
    conn.send_frame(websocket.ABNF(fin=0, opcode=websocket.ABNF.OPCODE_TEXT, data="{"))
    for _ in range(count):
        conn.send_frame(websocket.ABNF(fin=0, opcode=websocket.ABNF.OPCODE_CONT, data=""))
        if pause:
            time.sleep(pause)


def test_endless_empty_continuation_frames_are_closed(srv):
    conn = websocket.create_connection(srv.ws_url, timeout=30)
    try:
        conn.recv()
        try:
            fragments(conn, 5000)  # past MAX_FRAGMENTS (1024): it stops with no close of its own
        except OSError:
            pass  # closed while still sending: as it should be
        assert close_code(conn) == 1008
    finally:
        conn.close()
    assert WS(srv.ws_url).ping()["type"] == "pong"


def test_a_message_in_a_few_fragments_still_arrives(srv):
    client = WS(srv.ws_url)
    try:
        client.conn.send_frame(websocket.ABNF(fin=0, opcode=websocket.ABNF.OPCODE_TEXT, data='{"type":'))
        for piece in ('"ping"', ', "t": ', "7"):
            client.conn.send_frame(websocket.ABNF(fin=0, opcode=websocket.ABNF.OPCODE_CONT, data=piece))
        client.conn.send_frame(websocket.ABNF(fin=1, opcode=websocket.ABNF.OPCODE_CONT, data="}"))
        assert client.until(lambda f: f["type"] == "pong")[-1]["t"] == 7
    finally:
        client.close()


def test_a_message_that_takes_too_long_is_closed(srv, monkeypatch):
    from chat.web import ws_server
    monkeypatch.setattr(ws_server, "MESSAGE_S", 0.3)
    conn = websocket.create_connection(srv.ws_url, timeout=30)
    try:
        conn.recv()
        try:
            fragments(conn, 40, pause=0.05)
        except OSError:
            pass
        assert close_code(conn) == 1008
    finally:
        conn.close()


def test_a_close_never_waits_past_the_linger_bound(srv, monkeypatch):
    """A client that keeps sending after the close is read for LINGER_S at most, then cut."""
    from chat.web import ws_server
    monkeypatch.setattr(ws_server, "LINGER_S", 0.5)
    conn = websocket.create_connection(srv.ws_url, timeout=30)
    conn.recv()
    raw = conn.sock
    conn.send("x" * (300 * 1024))
    assert close_code(conn) == 1009
    sent, cut = 0, False
    try:
        while sent < 256 * 2**20:  # far past LINGER_BYTES (16 MiB): the server stops reading long before
            raw.sendall(b"\x00" * 65536)  # garbage, never a close frame
            sent += 65536
    except OSError:
        cut = True
    assert cut and sent <= 64 * 2**20
    raw.close()


def test_live_gunicorn_delivers_the_1009_of_a_2_mib_frame(server_factory):
    """The finding as it was made: gunicorn's gevent worker, default limits, a fresh connection."""
    live = server_factory("ws-limits")
    for _ in range(2):  # and again on a new connection
        conn = websocket.create_connection(live.ws_url, timeout=30)
        try:
            conn.recv()
            try:
                conn.send("x" * (2 * 1024 * 1024))
            except OSError:
                pass
            assert close_code(conn) == 1009
        finally:
            conn.close()
    assert WS(live.ws_url).ping()["type"] == "pong"
