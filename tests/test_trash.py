"""Archive and trash over HTTP, on the whole app with a real store (SQLite and PostgreSQL): delete moves
to the trash (found by nothing else), restore brings it back where it was, the trash empties itself
after CHAT_TRASH_DAYS; archive; several at once; an export of several that Import takes whole."""
import json
import time

import pytest

from chat import create_app
from chat.config import Settings
from chat.store import Store
from chat.web import conversation_bulk
from chat.web.identity import COOKIE
from fakes import FakeEngine

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def _app(tmp_path, store, **settings):
    return create_app(Settings(data_dir=str(tmp_path), sharing=True, **settings), engine=FakeEngine(), store=store)


@pytest.fixture
def app(tmp_path, store):
    return _app(tmp_path, store)


def _client(app, cookie):
    client = app.test_client()
    client.set_cookie(COOKIE, cookie)
    return client


@pytest.fixture
def alice(app):
    return _client(app, ALICE)


def _chat(store, client, text):
    c = store.create_conversation(client)
    store.add_user_message(client, c["id"], text)
    mid = store.start_assistant(c["id"])
    store.finish_assistant(mid, f"about {text}", "stop", {}, {})
    return c["id"]


def _listed(client, view="main"):
    response = client.get("/api/conversations", query_string={"view": view})
    assert response.status_code == 200
    return [c["id"] for c in response.get_json()]


def test_delete_moves_to_the_trash_where_nothing_else_finds_it_and_restore_brings_it_back(app, alice, store):
    older, conv, newer = (_chat(store, ALICE, t) for t in ("older owls", "middle moths", "newer newts"))
    token = alice.post(f"/api/conversations/{conv}/share", json={}).get_json()["token"]
    assert app.test_client().get(f"/s/{token}").status_code == 200
    response = alice.delete(f"/api/conversations/{conv}")
    assert response.status_code == 200 and response.get_json() == {"id": conv, "deleted": True, "trash": True}
    assert _listed(alice) == [newer, older]
    (trashed,) = alice.get("/api/conversations?view=trash").get_json()
    assert trashed["id"] == conv and trashed["deleted_at"] > time.time() - 60
    # In the trash: not opened, changed, searched, answered, exported or shown by its link.
    assert alice.get(f"/api/conversations/{conv}").status_code == 404
    assert alice.patch(f"/api/conversations/{conv}", json={"title": "x"}).status_code == 404
    assert alice.get("/api/search?q=moths").get_json() == {"results": []}
    assert alice.get(f"/api/conversations/{conv}/export?format=md").status_code == 404
    assert app.test_client().get(f"/s/{token}").status_code == 404
    assert not store.owns(ALICE, conv)
    # Undo: back in its place (its updated_at is kept), the link works again.
    restored = alice.post(f"/api/conversations/{conv}/restore", json={})
    assert restored.status_code == 200 and restored.get_json()["deleted_at"] is None
    assert _listed(alice) == [newer, conv, older] and _listed(alice, "trash") == []
    assert {r["conversation_id"] for r in alice.get("/api/search?q=moths").get_json()["results"]} == {conv}
    assert app.test_client().get(f"/s/{token}").status_code == 200
    assert alice.post(f"/api/conversations/{conv}/restore", json={}).status_code == 404  # not in the trash
    # Another client can neither trash nor restore it.
    bob = _client(app, BOB)
    assert bob.delete(f"/api/conversations/{conv}").status_code == 404
    alice.delete(f"/api/conversations/{conv}")
    assert bob.post(f"/api/conversations/{conv}/restore", json={}).status_code == 404
    # Deleted for good from the trash.
    assert alice.delete(f"/api/conversations/{conv}?forever=1").get_json()["trash"] is False
    assert _listed(alice, "trash") == []
    assert alice.post(f"/api/conversations/{conv}/restore", json={}).status_code == 404


def test_the_trash_empties_itself_after_its_days(app, alice, store, monkeypatch):
    conv, kept = _chat(store, ALICE, "old news"), _chat(store, ALICE, "fresh news")
    alice.delete(f"/api/conversations/{conv}")
    alice.delete(f"/api/conversations/{kept}")
    with store._conn() as db:  # deleted 31 days ago
        db.execute(f"UPDATE conversations SET deleted_at = {db.mark} WHERE id = {db.mark}",
                   (time.time() - 31 * 86400, conv))
    monkeypatch.setattr(conversation_bulk, "_emptied", [0.0])
    assert _listed(alice, "trash") == [kept]
    assert store.restore(ALICE, [conv]) == []  # gone for good


def test_no_trash_days_deletes_at_once(tmp_path, store):
    alice = _client(_app(tmp_path, store, trash_days=0), ALICE)
    conv = _chat(store, ALICE, "gone")
    assert alice.delete(f"/api/conversations/{conv}").get_json()["trash"] is False
    assert _listed(alice, "trash") == [] and store.restore(ALICE, [conv]) == []


def test_archive_leaves_the_list_and_comes_back(alice, store):
    conv, other = _chat(store, ALICE, "archived one"), _chat(store, ALICE, "other one")
    response = alice.patch(f"/api/conversations/{conv}", json={"archived": True})
    assert response.status_code == 200 and response.get_json()["archived"] is True
    assert _listed(alice) == [other] and _listed(alice, "archived") == [conv]
    assert alice.get(f"/api/conversations/{conv}").status_code == 200  # still opens, answers, searches
    assert alice.patch(f"/api/conversations/{conv}", json={"archived": "yes"}).status_code == 400
    alice.patch(f"/api/conversations/{conv}", json={"archived": False})
    assert set(_listed(alice)) == {conv, other} and _listed(alice, "archived") == []
    assert alice.get("/api/conversations?view=bin").status_code == 400


def test_several_at_once(app, alice, store):
    ids = [_chat(store, ALICE, f"topic {i}") for i in range(4)]
    theirs = _chat(store, BOB, "not yours")
    done = alice.post("/api/conversations/bulk", json={"action": "archive", "ids": ids[:2] + [theirs, "nope"]})
    assert done.status_code == 200 and done.get_json() == {"action": "archive", "ids": ids[:2]}
    assert sorted(_listed(alice, "archived")) == sorted(ids[:2])
    done = alice.post("/api/conversations/bulk", json={"action": "trash", "ids": ids[1:]})
    assert done.get_json()["ids"] == ids[1:]
    assert _listed(alice) == []  # the first is archived, the others in the trash
    assert sorted(_listed(alice, "trash")) == sorted(ids[1:])
    assert alice.post("/api/conversations/bulk", json={"action": "restore", "ids": ids}).get_json()["ids"] == ids[1:]
    assert alice.post("/api/conversations/bulk", json={"action": "delete", "ids": ids[2:]}).get_json()["ids"] == ids[2:]
    assert store.owns(BOB, theirs) and not store.owns(ALICE, ids[3])
    for bad in ({"action": "burn", "ids": ids}, {"action": "trash", "ids": []}, {"action": "trash", "ids": [1]},
                {"action": "trash"}, []):
        assert alice.post("/api/conversations/bulk", json=bad).status_code == 400
    assert alice.post("/api/conversations/bulk", json={"action": "trash", "ids": ["a"] * 501}).status_code == 413


def test_an_export_of_several_is_one_file_import_takes_whole(alice, store):
    ids = [_chat(store, ALICE, t) for t in ("first export", "second export")]
    response = alice.post("/api/conversations/export", json={"ids": ids, "format": "json"})
    assert response.status_code == 200 and "attachment" in response.headers["Content-Disposition"]
    bundle = json.loads(response.data)
    assert [c["id"] for c in bundle["conversations"]] == ids and all(c["tree"] for c in bundle["conversations"])
    md = alice.post("/api/conversations/export", json={"ids": ids, "format": "md"}).data.decode()
    assert "first export" in md and "second export" in md and "\n---\n" in md
    imported = alice.post("/api/conversations/import", json=bundle)
    assert imported.status_code == 201 and len(imported.get_json()["ids"]) == 2
    titles = {c["title"] for c in alice.get("/api/conversations").get_json()}
    assert {"first export (imported)", "second export (imported)"} <= titles
    assert alice.post("/api/conversations/export", json={"ids": ["nope"]}).status_code == 404


def test_branch_into_a_new_chat_from_any_message(alice, store):
    conv = _chat(store, ALICE, "first question")
    store.add_user_message(ALICE, conv, "second question")
    second_answer = store.start_assistant(conv)
    store.finish_assistant(second_answer, "second answer", "stop", {}, {})
    first_answer = store.get_conversation(ALICE, conv)["messages"][1]["id"]
    store.update(ALICE, conv, {"system": "Be brief.", "params": {"temperature": 0.2}})
    response = alice.post(f"/api/conversations/{conv}/branch", json={"message_id": first_answer})
    assert response.status_code == 201
    new = alice.get(f"/api/conversations/{response.get_json()['id']}").get_json()
    assert [m["content"] for m in new["messages"]] == ["first question", "about first question"]
    assert new["title"] == "first question (branch)" and new["system"] == "Be brief."
    assert new["params"] == {"temperature": 0.2}
    assert len(store.get_conversation(ALICE, conv)["messages"]) == 4  # the original is untouched
    other = _chat(store, BOB, "theirs")
    for path, body in ((conv, {"message_id": "0" * 32}), (other, {"message_id": first_answer}), (conv, {})):
        assert alice.post(f"/api/conversations/{path}/branch", json=body).status_code in (400, 404)


def test_edit_an_answer_as_a_new_version(alice, store):
    conv = _chat(store, ALICE, "a question")
    answer = store.get_conversation(ALICE, conv)["messages"][1]["id"]
    response = alice.put(f"/api/conversations/{conv}/messages/{answer}", json={"content": "My better answer"})
    assert response.status_code == 200
    last = response.get_json()["messages"][-1]
    assert (last["content"], last["reason"], last["status"]) == ("My better answer", "edited", "complete")
    assert last["versions"]["count"] == 2 and last["versions"]["index"] == 1
    assert store.history(conv)[-1] == {"role": "assistant", "content": "My better answer"}  # what the model sees
    question = store.get_conversation(ALICE, conv)["messages"][0]["id"]
    for target, body, status in ((question, {"content": "x"}, 400), (answer, {"content": " "}, 400),
                                 ("0" * 32, {"content": "x"}, 400), (answer, {"content": "x" * 70_000}, 413)):
        assert alice.put(f"/api/conversations/{conv}/messages/{target}", json=body).status_code == status
    exported = alice.get(f"/api/conversations/{conv}/export?format=json").get_json()
    assert alice.post("/api/conversations/import", json=exported).status_code == 201  # "edited" round-trips
