"""A database another process keeps locked: 503 overloaded with Retry-After (and an `overloaded`
frame on the socket), never an internal error; the server works again once it is free (issue 33, item 4)."""
from __future__ import annotations

import sqlite3

import pytest
from fakes import AppServer, FakeEngine
from helpers import WS

from chat import create_app
from chat.config import Settings
from chat.store import Store
from chat.store import sqlite as backend


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "BUSY_TIMEOUT_MS", 200)  # the wait a locked write gets, shortened
    settings = Settings(data_dir=str(tmp_path), rate_limit_per_min=0, rate_limit_per_ip_per_min=0)
    return create_app(settings, engine=FakeEngine(), store=Store(str(tmp_path / "chat.db")))


@pytest.fixture
def locked(tmp_path):
    """Another process's writer holding the database's write lock."""
    other = sqlite3.connect(str(tmp_path / "chat.db"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    yield other
    other.close()


def test_a_locked_database_is_overloaded_with_retry_after(app, tmp_path):
    client = app.test_client()
    client.get("/")
    body = {"title": "t", "messages": [{"role": "user", "content": "hello"}]}
    other = sqlite3.connect(str(tmp_path / "chat.db"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        response = client.post("/api/conversations/import", json=body)
        assert response.status_code == 503
        assert response.get_json()["error"]["code"] == "overloaded"
        assert "busy" in response.get_json()["error"]["message"]
        assert int(response.headers["Retry-After"]) > 0
    finally:
        other.rollback()
        other.close()
    assert client.post("/api/conversations/import", json=body).status_code == 201
    assert len(client.get("/api/conversations").get_json()) == 1


def test_a_locked_database_is_an_overloaded_frame_on_the_socket(app, locked):
    srv = AppServer(app)
    ws = WS(srv.ws_url)
    try:
        frames = ws.chat("hello", rid="b")
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "overloaded", frames[-1]
        locked.rollback()
        assert ws.chat("hello", rid="c")[-1]["type"] == "done"
    finally:
        ws.close()
        srv.close()
