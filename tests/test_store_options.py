"""The store's per-conversation settings, pinning, titles that follow edits, and the whole tree through export."""
import json
import sqlite3
from pathlib import Path

import pytest
from helpers import ALICE, BOB, LIMIT
from helpers import add_answer as _answer
from helpers import error_code as _code

from chat.store import MIGRATIONS, Store, pg_schema


def _ids(store, client=ALICE):
    return [c["id"] for c in store.list_conversations(client)]


def test_settings_are_stored_shown_and_changed(store):
    c = store.create_conversation(ALICE, system="Be brief.", params={"temperature": 0.2, "seed": 7}, model="m2")
    got = store.get_conversation(ALICE, c["id"])
    assert (got["system"], got["params"], got["model"], got["pinned"]) == ("Be brief.", {"temperature": 0.2, "seed": 7},
                                                                           "m2", False)
    assert store.options(c["id"]) == {"params": {"temperature": 0.2, "seed": 7}, "model": "m2"}
    changed = store.update(ALICE, c["id"], {"system": "Be long.", "params": {"top_p": 0.5}, "model": None})
    assert (changed["system"], changed["params"], changed["model"]) == ("Be long.", {"top_p": 0.5}, None)
    assert "messages" not in changed
    assert store.history(c["id"]) == [{"role": "system", "content": "Be long."}]
    store.update(ALICE, c["id"], {"system": "", "params": {}})
    assert store.options(c["id"]) == {"params": {}, "model": None}
    assert store.history(c["id"]) == []
    assert store.update(BOB, c["id"], {"system": "stolen"}) is None
    assert store.get_conversation(ALICE, c["id"])["system"] is None
    assert store.options("f" * 32) == {"params": {}, "model": None}
    with pytest.raises(ValueError):
        store.update(ALICE, c["id"], {"client_id": BOB})


def test_rename_pin_and_settings_keep_the_order(store):
    old, new = store.create_conversation(ALICE), store.create_conversation(ALICE)
    assert _ids(store) == [new["id"], old["id"]]
    assert store.rename(ALICE, old["id"], "Renamed")
    store.update(ALICE, old["id"], {"params": {"seed": 1}})
    assert _ids(store) == [new["id"], old["id"]]
    store.update(ALICE, old["id"], {"pinned": True})
    listed = store.list_conversations(ALICE)
    assert [(c["id"], c["pinned"]) for c in listed] == [(old["id"], True), (new["id"], False)]
    store.add_user_message(ALICE, new["id"], "a new message still comes after the pinned one")
    assert _ids(store) == [old["id"], new["id"]]
    store.update(ALICE, old["id"], {"pinned": False})
    assert _ids(store) == [new["id"], old["id"]]


def test_title_follows_an_edited_first_message_unless_renamed(store):
    c = store.create_conversation(ALICE)
    u1 = store.add_user_message(ALICE, c["id"], "first question")["id"]
    _answer(store, c["id"], "answer")
    u2 = store.add_user_message(ALICE, c["id"], "second question")["id"]
    store.add_user_message(ALICE, c["id"], "second, edited", replaces=u2)
    assert store.get_conversation(ALICE, c["id"])["title"] == "first question"
    edited = store.add_user_message(ALICE, c["id"], "first question, edited", replaces=u1)["id"]
    assert store.get_conversation(ALICE, c["id"])["title"] == "first question, edited"
    store.rename(ALICE, c["id"], "Mine")
    store.add_user_message(ALICE, c["id"], "edited again", replaces=edited)
    assert store.get_conversation(ALICE, c["id"])["title"] == "Mine"
    named = store.create_conversation(ALICE, title="Named at start")
    root = store.add_user_message(ALICE, named["id"], "q")["id"]
    store.add_user_message(ALICE, named["id"], "q2", replaces=root)
    assert store.get_conversation(ALICE, named["id"])["title"] == "Named at start"


def _branchy(store):
    """U1 with two versions; under the second, A1 with two answer versions, the first one active."""
    c = store.create_conversation(ALICE, system="Sys", params={"seed": 3}, model="m1")
    u1 = store.add_user_message(ALICE, c["id"], "question one", [{"name": "a.txt", "text": "A"}])["id"]
    _answer(store, c["id"], "answer to one")
    u1b = store.add_user_message(ALICE, c["id"], "question one, edited", replaces=u1)["id"]
    first = _answer(store, c["id"], "first answer to the edit")
    _answer(store, c["id"], "second answer to the edit", parent=u1b, reason="cancelled")
    store.set_active(ALICE, c["id"], first)
    return c["id"]


def test_export_carries_the_whole_tree_and_import_restores_it(store):
    conv_id = _branchy(store)
    exported = json.loads(store.export(ALICE, conv_id, "json")[0])
    assert len(exported["tree"]) == 5 and exported["active_id"] == exported["messages"][-1]["id"]
    assert [m["content"] for m in exported["messages"]] == ["question one, edited", "first answer to the edit"]
    new_id = store.import_conversation(ALICE, exported, LIMIT)
    got = store.get_conversation(ALICE, new_id)
    assert [m["content"] for m in got["messages"]] == ["question one, edited", "first answer to the edit"]
    assert [(m["versions"]["index"], m["versions"]["count"]) for m in got["messages"]] == [(1, 2), (0, 2)]
    assert (got["title"], got["system"], got["params"], got["model"]) == (
        "question one, edited (imported)", "Sys", {"seed": 3}, "m1")
    # every version came along, with its fields: switch to the others
    other = store.set_active(ALICE, new_id, got["messages"][0]["versions"]["ids"][0])
    assert [m["content"] for m in other["messages"]] == ["question one", "answer to one"]
    assert other["messages"][0]["attachments"] == [{"name": "a.txt", "text": "A"}]
    second = store.set_active(ALICE, new_id, got["messages"][1]["versions"]["ids"][1])
    assert second["messages"][1]["reason"] == "cancelled" and second["messages"][1]["status"] == "partial"
    again = json.loads(store.export(ALICE, new_id, "json")[0])
    keep = ("role", "content", "attachments", "status", "reason", "usage", "timings", "created_at")
    assert [{k: m[k] for k in keep} for m in again["tree"]] == [{k: m[k] for k in keep} for m in exported["tree"]]


def test_older_single_path_exports_still_import(store):
    conv_id = _branchy(store)
    old = json.loads(store.export(ALICE, conv_id, "json")[0])
    del old["tree"], old["active_id"], old["params"], old["model"], old["pinned"]
    got = store.get_conversation(ALICE, store.import_conversation(ALICE, old, LIMIT))
    assert [m["content"] for m in got["messages"]] == ["question one, edited", "first answer to the edit"]
    assert all(m["versions"]["count"] == 1 for m in got["messages"])


@pytest.mark.parametrize("tree, active", [
    ("x", None),
    ([{"id": "a", "parent_id": None, "role": "user", "content": "q"}, {"id": "a", "parent_id": None,
                                                                       "role": "user", "content": "q"}], None),
    ([{"id": "b", "parent_id": "a", "role": "assistant", "content": "x"},
      {"id": "a", "parent_id": None, "role": "user", "content": "q"}], None),
    ([{"id": 5, "parent_id": None, "role": "user", "content": "q"}], None),
    ([{"parent_id": None, "role": "user", "content": "q"}], None),
    ([{"id": "a", "parent_id": None, "role": "tool", "content": "q"}], None),
    ([{"id": "a", "parent_id": None, "role": "user", "content": "q"}], "zzz"),
])
def test_malformed_trees_are_refused(store, tree, active):
    body = {"messages": [], "tree": tree, "active_id": active}
    assert _code(store.import_conversation, ALICE, body, LIMIT) == "bad_message"
    assert store.list_conversations(ALICE) == []


def test_imported_tree_counts_against_the_message_quota(db_path):
    s = Store(db_path, max_messages=4)
    try:
        tree = [{"id": str(i), "parent_id": None, "role": "user", "content": "q"} for i in range(5)]
        assert _code(s.import_conversation, ALICE, {"tree": tree}, LIMIT) == "too_large"
        assert _code(s.import_conversation, ALICE, {"tree": [], "params": {"seed": "x"}}, LIMIT) == "bad_message"
    finally:
        s.close()


def _version_two(db_path, db_backend):
    """A store at schema 2 (before per-conversation settings) with three conversations: titled by its
    first message, by its first message cut at "…", and renamed by the user."""
    long = "word " * 30
    rows = [("a" * 32, "short question", "short question"), ("b" * 32, long, "word word word…"),
            ("c" * 32, "asked this", "My own name")]
    if db_backend == "sqlite":
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(db_path, isolation_level=None)
        for statements in MIGRATIONS[:2]:
            for statement in statements:
                db.execute(statement)
        db.execute("PRAGMA user_version = 2")
        mark = "?"
    else:
        import psycopg
        db = psycopg.connect(db_path, autocommit=True)
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version VALUES (1)")
        for statement in pg_schema.MIGRATIONS[0]:
            db.execute(statement)
        mark = "%s"
    for conv, content, title in rows:
        db.execute(f"INSERT INTO conversations (id, client_id, title, title_set, created_at, updated_at)"
                   f" VALUES ({mark}, {mark}, {mark}, 1, 1.0, 1.0)", (conv, ALICE, title))
        db.execute(f"INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
                   f" VALUES ({mark}, {mark}, 'user', {mark}, 'complete', 2.0)", (conv[:31] + "1", conv, content))
        db.execute(f"UPDATE conversations SET active_id = {mark} WHERE id = {mark}", (conv[:31] + "1", conv))
    db.close()
    return [r[0] for r in rows]


def test_migration_keeps_user_titles_when_the_first_message_is_edited(db_path, db_backend):
    ids = _version_two(db_path, db_backend)
    s = Store(db_path)
    try:
        assert s.schema_version == len(s.migrations)
        for conv in ids:
            first = s.get_conversation(ALICE, conv)["messages"][0]
            assert s.get_conversation(ALICE, conv)["pinned"] is False
            s.add_user_message(ALICE, conv, "edited first message", replaces=first["id"])
        assert [s.get_conversation(ALICE, c)["title"] for c in ids] == [
            "edited first message", "edited first message", "My own name"]
    finally:
        s.close()
