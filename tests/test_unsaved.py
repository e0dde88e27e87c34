"""Nothing lost on a full disk (issue 45): an answer that streamed while the store was full is kept in
memory, the client's ``done`` says it is not stored yet, and it is saved when space returns, by the
retry or before the next turn reads the history; never a ``streaming`` row with no text."""
from __future__ import annotations

import time

import pytest

from chat import unsaved
from chat.errors import StorageFull
from helpers import WS, conv_of

ALICE = "alice-unsaved-0123456789abcdef"
PARAMS = {"max_new_tokens": 6}


@pytest.fixture
def srv(app_factory):
    return app_factory(max_new_tokens=8)


class FullDisk:
    """The store's answer writes refused as a full disk refuses them, until ``free``."""

    def __init__(self, store, monkeypatch):
        self.full = True
        for name in ("finish_assistant", "save_partial"):
            real = getattr(store, name)
            monkeypatch.setattr(store, name, self._guard(real))

    def _guard(self, real):
        def write(*args, **kwargs):
            if self.full:
                raise StorageFull()
            return real(*args, **kwargs)
        return write

    def free(self) -> None:
        self.full = False


def _stored(srv, conv: str) -> list:
    return [(m["role"], m["status"], m["content"]) for m in
            srv.state.store.get_conversation(ALICE, conv)["messages"]]


def test_a_finished_answer_the_full_store_refused_is_saved_when_space_returns(srv, monkeypatch):
    monkeypatch.setattr(unsaved, "RETRY_S", 0.2)
    client = WS(srv.ws_url, cookie=f"chat_client={ALICE}")
    conv = conv_of(client.chat("first", rid="a", params=PARAMS))  # stored whole: the disk has room
    disk = FullDisk(srv.state.store, monkeypatch)
    frames = client.chat("second", rid="b", conversation_id=conv, params=PARAMS)
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    done = frames[-1]
    assert done["type"] == "done" and done["reason"] == "length" and text
    assert done["stored"] is False and "saved when space returns" in done["message"]
    assert _stored(srv, conv)[-1][:2] == ("assistant", "streaming")  # not yet: kept in memory
    assert len(srv.state.turns.unsaved) == 1
    disk.free()
    deadline = time.monotonic() + 10
    while _stored(srv, conv)[-1] != ("assistant", "complete", text):
        assert time.monotonic() < deadline, _stored(srv, conv)
        time.sleep(0.05)
    assert len(srv.state.turns.unsaved) == 0
    client.close()


def test_the_next_turn_saves_a_kept_answer_before_it_reads_the_history(srv, monkeypatch):
    monkeypatch.setattr(unsaved, "RETRY_S", 3600)  # only the next turn can save it
    client = WS(srv.ws_url, cookie=f"chat_client={ALICE}")
    conv = conv_of(client.chat("first", rid="a", params=PARAMS))
    disk = FullDisk(srv.state.store, monkeypatch)
    frames = client.chat("second", rid="b", conversation_id=conv, params=PARAMS)
    kept = "".join(f["text"] for f in frames if f["type"] == "delta")
    disk.free()
    assert client.chat("third", rid="c", conversation_id=conv, params=PARAMS)[-1].get("stored", True) is True
    rows = _stored(srv, conv)
    assert ("assistant", "complete", kept) in rows
    assert not [r for r in rows if r[1] == "streaming"]
    assert [r[2] for r in rows if r[0] == "user"] == ["first", "second", "third"]
    client.close()
