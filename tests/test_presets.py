"""Presets over the HTTP API, on the whole app with a real store (SQLite and PostgreSQL): a client's
own named sets of a system prompt and sampling parameters, checked as the chat frame's, never
another client's."""
from __future__ import annotations

import pytest
from fakes import FakeEngine

from chat import create_app
from chat.config import Settings
from chat.store import Store
from chat.store.presets import MAX_PRESETS
from chat.web.identity import COOKIE

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"
TERSE = {"name": "Terse", "system": "Answer in one line.", "params": {"temperature": 0.2, "max_new_tokens": 64}}


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


@pytest.fixture
def app(tmp_path, store):
    return create_app(Settings(data_dir=str(tmp_path), max_new_tokens=512), engine=FakeEngine(), store=store)


def client_of(app, cookie):
    client = app.test_client()
    client.set_cookie(COOKIE, cookie)
    return client


def test_make_list_change_and_delete_a_preset(app):
    alice = client_of(app, ALICE)
    assert alice.get("/api/presets").json == []
    made = alice.post("/api/presets", json=TERSE)
    assert made.status_code == 201
    preset = made.json
    assert (preset["name"], preset["system"], preset["params"]) == ("Terse", "Answer in one line.",
                                                                    {"temperature": 0.2, "max_new_tokens": 64})
    alice.post("/api/presets", json={"name": "Creative", "params": {"temperature": 1.3}})
    assert [p["name"] for p in alice.get("/api/presets").json] == ["Terse", "Creative"]
    changed = alice.put(f"/api/presets/{preset['id']}", json={"name": "Terser", "system": None, "params": {}})
    assert changed.status_code == 200 and (changed.json["name"], changed.json["system"], changed.json["params"]) == (
        "Terser", None, {})
    assert alice.delete(f"/api/presets/{preset['id']}").json == {"id": preset["id"], "deleted": True}
    assert [p["name"] for p in alice.get("/api/presets").json] == ["Creative"]


def test_presets_are_each_clients_own(app):
    alice, bob = client_of(app, ALICE), client_of(app, BOB)
    preset = alice.post("/api/presets", json=TERSE).json
    assert bob.get("/api/presets").json == []
    assert bob.put(f"/api/presets/{preset['id']}", json=TERSE).status_code == 404
    assert bob.delete(f"/api/presets/{preset['id']}").status_code == 404
    assert bob.post("/api/presets", json=TERSE).status_code == 201  # the same name is Bob's own
    assert [p["name"] for p in alice.get("/api/presets").json] == ["Terse"]


@pytest.mark.parametrize("body, code", [
    ({"name": ""}, "bad_message"),
    ({"name": "x" * 81}, "bad_message"),
    ({"name": 5}, "bad_message"),
    ({"name": "Hot", "params": {"temperature": 5}}, "bad_message"),
    ({"name": "Long", "params": {"max_new_tokens": 513}}, "bad_message"),
    ({"name": "Sys", "system": 7}, "bad_message"),
    ({"name": "Big", "system": "x" * 20000}, "too_large"),
    ([1, 2], "bad_message"),
])
def test_bad_presets_are_refused_with_their_reason(app, body, code):
    response = client_of(app, ALICE).post("/api/presets", json=body)
    assert response.status_code in (400, 413) and response.json["error"]["code"] == code
    assert client_of(app, ALICE).get("/api/presets").json == []


def test_names_are_unique_and_presets_bounded(app):
    alice = client_of(app, ALICE)
    assert alice.post("/api/presets", json=TERSE).status_code == 201
    clash = alice.post("/api/presets", json=TERSE)
    assert clash.status_code == 400 and "already" in clash.json["error"]["message"]
    for i in range(MAX_PRESETS - 1):
        assert alice.post("/api/presets", json={"name": f"p{i}"}).status_code == 201
    over = alice.post("/api/presets", json={"name": "one too many"})
    assert over.status_code == 413 and over.json["error"]["code"] == "too_large"


def test_a_write_from_another_site_is_refused(app):
    response = client_of(app, ALICE).post("/api/presets", json=TERSE, headers={"Origin": "https://elsewhere.example"})
    assert response.status_code == 403
    assert client_of(app, ALICE).get("/api/presets").json == []
