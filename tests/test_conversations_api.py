"""The HTTP conversation API, on the whole app with a real store (SQLite and PostgreSQL) and a fake engine."""
import json

import pytest
from fakes import FakeEngine

from chat import create_app
from chat.config import Settings
from chat.store import Store
from chat.web import conversations_api as conversations
from chat.web.identity import COOKIE

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


@pytest.fixture
def app(tmp_path, store):
    return create_app(Settings(data_dir=str(tmp_path)), engine=FakeEngine(), store=store)


def _client(app, cookie):
    client = app.test_client()
    if cookie is not None:
        client.set_cookie(COOKIE, cookie)
    return client


@pytest.fixture
def alice(app):
    return _client(app, ALICE)


@pytest.fixture
def bob(app):
    return _client(app, BOB)


@pytest.fixture
def conv(store):
    """ALICE's conversation with one exchange."""
    c = store.create_conversation(ALICE, system="Be brief.")
    store.add_user_message(ALICE, c["id"], "What is 2+2?")
    mid = store.start_assistant(c["id"])
    store.finish_assistant(mid, "4", "stop", {"prompt_tokens": 9, "completion_tokens": 1}, {"total_ms": 5.0})
    return c


def _not_found(response):
    assert response.status_code == 404
    assert response.get_json() == {"error": {"code": "not_found", "message": "conversation not found"}}


def test_list(alice, store, conv):
    newer = store.create_conversation(ALICE)
    response = alice.get("/api/conversations")
    assert response.status_code == 200
    assert response.headers["Cache-Control"] == "no-store"
    listed = response.get_json()
    assert [c["id"] for c in listed] == [newer["id"], conv["id"]]
    assert listed[1] == {"id": conv["id"], "title": "What is 2+2?", "system": "Be brief.",
                         "created_at": conv["created_at"], "updated_at": listed[1]["updated_at"],
                         "pinned": False, "params": {}, "model": None, "answering": False,
                         "archived": False, "deleted_at": None}


@pytest.mark.parametrize("cookie", [None, BOB, "short", "bad cookie value with spaces!!"])
def test_list_is_empty_for_others(app, conv, cookie):
    response = _client(app, cookie).get("/api/conversations")
    assert response.status_code == 200 and response.get_json() == []


def test_show(alice, conv):
    response = alice.get(f"/api/conversations/{conv['id']}")
    assert response.status_code == 200
    body = response.get_json()
    assert body["id"] == conv["id"] and body["title"] == "What is 2+2?"
    assert [(m["role"], m["content"], m["status"]) for m in body["messages"]] == [
        ("user", "What is 2+2?", "complete"), ("assistant", "4", "complete")]
    assert body["messages"][1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 1}


@pytest.mark.parametrize("title, stored", [("Arithmetic", "Arithmetic"), ("  padded  ", "padded"),
                                           ("t" * 200, "t" * 200), ("日本語 🙂", "日本語 🙂")])
def test_rename(alice, store, conv, title, stored):
    response = alice.patch(f"/api/conversations/{conv['id']}", json={"title": title})
    assert response.status_code == 200
    body = response.get_json()
    assert (body["id"], body["title"]) == (conv["id"], stored) and "messages" not in body
    assert store.get_conversation(ALICE, conv["id"])["title"] == stored


@pytest.mark.parametrize("kwargs", [
    {"data": "not json", "content_type": "application/json"},
    {"data": "{\"title\": ", "content_type": "application/json"},
    {"data": "title=x", "content_type": "application/x-www-form-urlencoded"},
    {"json": ["title", "x"]},
    {"json": "x"},
    {"json": {}},
    {"json": {"name": "x"}},
    {"json": {"title": ""}},
    {"json": {"title": "   "}},
    {"json": {"title": 5}},
    {"json": {"title": None}},
    {"json": {"title": ["x"]}},
    {"json": {"title": "t" * 201}},
])
def test_rename_rejects_bad_body(alice, store, conv, kwargs):
    response = alice.patch(f"/api/conversations/{conv['id']}", **kwargs)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "bad_message"
    assert store.get_conversation(ALICE, conv["id"])["title"] == "What is 2+2?"


def test_patch_changes_pin_and_settings_and_keeps_the_order(alice, store, conv):
    newer = store.create_conversation(ALICE)
    url = f"/api/conversations/{conv['id']}"
    body = alice.patch(url, json={"pinned": True, "system": "Be long.", "model": "fake-model",
                                  "params": {"temperature": 0.3, "seed": 9, "unknown": 1}}).get_json()
    assert (body["pinned"], body["system"], body["model"], body["params"]) == (
        True, "Be long.", "fake-model", {"temperature": 0.3, "seed": 9})
    assert alice.get(url).get_json()["params"] == {"temperature": 0.3, "seed": 9}
    assert [c["id"] for c in alice.get("/api/conversations").get_json()] == [conv["id"], newer["id"]]
    body = alice.patch(url, json={"pinned": False, "system": None, "params": None, "model": None}).get_json()
    assert (body["pinned"], body["system"], body["model"], body["params"]) == (False, None, None, {})
    assert [c["id"] for c in alice.get("/api/conversations").get_json()] == [newer["id"], conv["id"]]


@pytest.mark.parametrize("body, code", [
    ({"pinned": "yes"}, "bad_message"), ({"pinned": 1}, "bad_message"),
    ({"system": 5}, "bad_message"), ({"system": "s" * (Settings().max_content_chars + 1)}, "too_large"),
    ({"params": {"temperature": 3}}, "bad_message"), ({"params": {"seed": 1.5}}, "bad_message"),
    ({"params": {"max_new_tokens": Settings().max_new_tokens + 1}}, "bad_message"), ({"params": []}, "bad_message"),
    ({"model": "not-served"}, "bad_message"), ({"model": ""}, "bad_message"), ({"model": 3}, "bad_message"),
    ({"title": "ok", "pinned": "no"}, "bad_message"),
])
def test_patch_rejects_bad_fields(alice, store, conv, body, code):
    response = alice.patch(f"/api/conversations/{conv['id']}", json=body)
    assert response.status_code == (413 if code == "too_large" else 400)
    assert response.get_json()["error"]["code"] == code
    kept = store.get_conversation(ALICE, conv["id"])
    assert (kept["title"], kept["pinned"], kept["system"], kept["params"]) == ("What is 2+2?", False, "Be brief.", {})


def test_delete(alice, store, conv):
    response = alice.delete(f"/api/conversations/{conv['id']}")
    assert response.status_code == 200 and response.get_json() == {"id": conv["id"], "deleted": True, "trash": True}
    assert store.get_conversation(ALICE, conv["id"]) is None
    _not_found(alice.delete(f"/api/conversations/{conv['id']}"))  # already in the trash (test_trash.py)
    _not_found(alice.get(f"/api/conversations/{conv['id']}"))


@pytest.mark.parametrize("query, content_type, ext", [
    ("?format=md", "text/markdown; charset=utf-8", "md"),
    ("", "text/markdown; charset=utf-8", "md"),
    ("?format=json", "application/json", "json"),
])
def test_export(alice, conv, query, content_type, ext):
    response = alice.get(f"/api/conversations/{conv['id']}/export{query}")
    assert response.status_code == 200
    assert response.content_type == content_type
    assert response.headers["Content-Disposition"] == f'attachment; filename="what-is-2-2-{conv["id"][:8]}.{ext}"'
    text = response.get_data(as_text=True)
    if ext == "json":
        assert json.loads(text)["messages"][1]["content"] == "4"
    else:
        assert text.startswith("# What is 2+2?") and "## Assistant\n\n4" in text


@pytest.mark.parametrize("fmt", ["pdf", "MD", "", "json "])
def test_export_rejects_bad_format(alice, conv, fmt):
    response = alice.get(f"/api/conversations/{conv['id']}/export", query_string={"format": fmt})
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "bad_message"


ROUTES = [
    ("get", "/api/conversations/{id}", {}),
    ("patch", "/api/conversations/{id}", {"json": {"title": "stolen"}}),
    ("delete", "/api/conversations/{id}", {}),
    ("get", "/api/conversations/{id}/export?format=md", {}),
    ("get", "/api/conversations/{id}/export?format=json", {}),
]


@pytest.mark.parametrize("method, path, kwargs", ROUTES)
@pytest.mark.parametrize("cookie", [BOB, None])
def test_other_clients_get_not_found(app, store, conv, method, path, kwargs, cookie):
    client = _client(app, cookie)
    _not_found(getattr(client, method)(path.format(id=conv["id"]), **kwargs))
    kept = store.get_conversation(ALICE, conv["id"])
    assert kept["title"] == "What is 2+2?" and len(kept["messages"]) == 2


@pytest.mark.parametrize("method, path, kwargs", ROUTES)
@pytest.mark.parametrize("bad_id", ["nope", "0" * 32, "0" * 33, "A" * 32, "%27%20OR%201%3D1", "..", "%00"])
def test_malformed_or_unknown_ids_get_not_found(alice, conv, method, path, kwargs, bad_id):
    _not_found(getattr(alice, method)(path.format(id=bad_id), **kwargs))


def test_show_has_versions_and_active_switches_them(alice, store, conv):
    first = store.get_conversation(ALICE, conv["id"])["messages"]
    edited = store.add_user_message(ALICE, conv["id"], "What is 3+3?", replaces=first[0]["id"])
    shown = alice.get(f"/api/conversations/{conv['id']}").get_json()["messages"]
    assert [m["content"] for m in shown] == ["What is 3+3?"]
    assert shown[0]["parent_id"] is None
    assert shown[0]["versions"] == {"index": 1, "count": 2, "ids": [first[0]["id"], edited["id"]]}
    response = alice.post(f"/api/conversations/{conv['id']}/active", json={"message_id": first[0]["id"]})
    assert response.status_code == 200
    body = response.get_json()
    assert [m["content"] for m in body["messages"]] == ["What is 2+2?", "4"]
    assert body["messages"][1]["parent_id"] == first[0]["id"]
    assert body == alice.get(f"/api/conversations/{conv['id']}").get_json()


@pytest.mark.parametrize("body", [{}, {"message_id": 5}, {"message_id": "0" * 32}, {"message_id": "x"}, None])
def test_active_rejects_bad_message_ids(alice, conv, body):
    response = alice.post(f"/api/conversations/{conv['id']}/active", json=body)
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "bad_message"


def test_active_of_another_client_is_not_found(bob, store, conv):
    message_id = store.get_conversation(ALICE, conv["id"])["messages"][0]["id"]
    _not_found(bob.post(f"/api/conversations/{conv['id']}/active", json={"message_id": message_id}))


def test_import_round_trip(alice, store, conv):
    exported = alice.get(f"/api/conversations/{conv['id']}/export?format=json").get_data()
    response = alice.post("/api/conversations/import", data=exported, content_type="application/json")
    assert response.status_code == 201
    new_id = response.get_json()["id"]
    assert new_id != conv["id"] and set(response.get_json()) == {"id"}
    again = json.loads(alice.get(f"/api/conversations/{new_id}/export?format=json").get_data())
    before = json.loads(exported)
    assert again["title"] == before["title"] + " (imported)" and again["system"] == before["system"]
    keep = ("role", "content", "status", "reason", "usage", "timings", "created_at", "attachments")
    assert [{k: m[k] for k in keep} for m in again["messages"]] == [{k: m[k] for k in keep} for m in before["messages"]]


def test_import_openai_messages(alice):
    response = alice.post("/api/conversations/import", json={"title": "Imported", "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]})
    assert response.status_code == 201
    listed = alice.get("/api/conversations").get_json()
    assert [(c["id"], c["title"]) for c in listed] == [(response.get_json()["id"], "Imported (imported)")]


@pytest.mark.parametrize("kwargs", [
    {"data": "not json", "content_type": "application/json"},
    {"data": b"\xff\xfe", "content_type": "application/json"},
    {"json": []}, {"json": {"messages": [{"role": "robot", "content": "x"}]}},
])
def test_import_rejects_malformed(alice, kwargs):
    response = alice.post("/api/conversations/import", **kwargs)
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "bad_message"
    assert alice.get("/api/conversations").get_json() == []


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "assistant", "content": "x" * (conversations.MAX_IMPORT_BYTES + 1)}]},
    {"messages": [{"role": "user", "content": "x" * (Settings().max_content_chars + 1)}]},
])
def test_import_refuses_oversized(alice, body):
    response = alice.post("/api/conversations/import", json=body)
    assert response.status_code == 413 and response.get_json()["error"]["code"] == "too_large"
    assert alice.get("/api/conversations").get_json() == []


def test_import_needs_an_identity(app):
    response = _client(app, None).post("/api/conversations/import", json={"messages": []})
    assert response.status_code == 400


def test_search(alice, conv):
    response = alice.get("/api/search", query_string={"q": "2+2"})
    assert response.status_code == 200 and response.headers["Cache-Control"] == "no-store"
    (hit,) = response.get_json()["results"]
    assert set(hit) >= {"conversation_id", "title", "message_id", "snippet", "highlights"}
    assert hit["conversation_id"] == conv["id"] and hit["title"] == "What is 2+2?"
    assert all(hit["snippet"][s:e] in ("2", "2+2") for s, e in hit["highlights"]) and hit["highlights"]
    assert alice.get("/api/search").get_json() == {"results": []}
    assert alice.get("/api/search", query_string={"q": "x" * 501}).status_code == 400


def test_search_is_isolated_between_clients(app, alice, bob, store, conv):
    theirs = store.create_conversation(BOB)
    store.add_user_message(BOB, theirs["id"], "What is the launch code?")
    assert alice.get("/api/search?q=launch").get_json() == {"results": []}
    assert [r["conversation_id"] for r in bob.get("/api/search?q=launch").get_json()["results"]] == [theirs["id"]]
    assert bob.get("/api/search?q=2").get_json() == {"results": []}
    assert _client(app, None).get("/api/search?q=launch").get_json() == {"results": []}
    assert [r["conversation_id"] for r in alice.get("/api/search?q=what").get_json()["results"]] == [conv["id"]]
