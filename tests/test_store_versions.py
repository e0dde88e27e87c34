"""The store's message tree: migration, versions, continue, attachments, search, import."""
import json
import sqlite3

import pytest
from helpers import ALICE, BOB, LIMIT
from helpers import add_answer as _answer
from helpers import error_code as _code

from chat.store import MIGRATIONS, Store


@pytest.fixture
def chat(store):
    """ALICE: U1 "first question", A1, U2 "second question", A2."""
    c = store.create_conversation(ALICE, system="Be brief.")
    u1 = store.add_user_message(ALICE, c["id"], "first question")["id"]
    a1 = _answer(store, c["id"], "first answer")
    u2 = store.add_user_message(ALICE, c["id"], "second question")["id"]
    a2 = _answer(store, c["id"], "second answer")
    return c["id"], [u1, a1, u2, a2]


def _path(store, conv_id, client=ALICE):
    return [m["content"] for m in store.get_conversation(client, conv_id)["messages"]]


def test_migration_turns_old_conversations_into_single_paths(tmp_path):
    """SQLite only: PostgreSQL stores began with the tree schema."""
    db_path = tmp_path / "chat.db"
    old = sqlite3.connect(db_path, isolation_level=None)
    for statement in MIGRATIONS[0]:
        old.execute(statement)
    old.execute("PRAGMA user_version = 1")
    for conv in ("a" * 32, "b" * 32):
        old.execute("INSERT INTO conversations VALUES (?, ?, 'T', 1, NULL, 1.0, 1.0)", (conv, ALICE))
    # Interleaved, as two conversations written at the same time would be.
    rows = [("1" * 32, "a" * 32, "user", "alpha question"), ("2" * 32, "b" * 32, "user", "beta question"),
            ("3" * 32, "a" * 32, "assistant", "alpha answer"), ("4" * 32, "b" * 32, "assistant", "beta answer"),
            ("5" * 32, "a" * 32, "user", "alpha again")]
    for mid, conv, role, content in rows:
        old.execute("INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
                    " VALUES (?, ?, ?, ?, 'complete', 2.0)", (mid, conv, role, content))
    old.close()
    store = Store(db_path)
    try:
        assert store.schema_version == len(MIGRATIONS)
        alpha = store.get_conversation(ALICE, "a" * 32)["messages"]
        assert [(m["id"], m["parent_id"]) for m in alpha] == [("1" * 32, None), ("3" * 32, "1" * 32),
                                                              ("5" * 32, "3" * 32)]
        assert all(m["versions"] == {"index": 0, "count": 1, "ids": [m["id"]]} for m in alpha)
        assert _path(store, "b" * 32) == ["beta question", "beta answer"]
        assert store.history("a" * 32)[-1] == {"role": "user", "content": "alpha again"}
        assert [r["message_id"] for r in store.search(ALICE, "beta answer")] == ["4" * 32]
        store.add_user_message(ALICE, "b" * 32, "beta again")
        assert _path(store, "b" * 32) == ["beta question", "beta answer", "beta again"]
    finally:
        store.close()


def test_edit_adds_a_version_and_keeps_the_old_branch(store, chat):
    conv_id, (u1, a1, u2, a2) = chat
    edited = store.add_user_message(ALICE, conv_id, "second, better", replaces=u2)
    assert edited["parent_id"] == a1
    a3 = _answer(store, conv_id, "better answer")
    got = store.get_conversation(ALICE, conv_id)["messages"]
    assert [m["content"] for m in got] == ["first question", "first answer", "second, better", "better answer"]
    assert got[2]["versions"] == {"index": 1, "count": 2, "ids": [u2, edited["id"]]}
    assert store.history(conv_id)[-2:] == [{"role": "user", "content": "second, better"},
                                           {"role": "assistant", "content": "better answer"}]
    # Switching back restores the old branch down to its newest descendant.
    switched = store.set_active(ALICE, conv_id, u2)
    assert [m["id"] for m in switched["messages"]] == [u1, a1, u2, a2]
    assert switched["messages"][2]["versions"]["index"] == 0
    assert [m["id"] for m in store.set_active(ALICE, conv_id, u1)["messages"]] == [u1, a1, edited["id"], a3]


def test_edit_of_first_message_is_a_root_version(store, chat):
    conv_id, (u1, *_) = chat
    first = store.add_user_message(ALICE, conv_id, "another start", replaces=u1)
    assert first["parent_id"] is None
    got = store.get_conversation(ALICE, conv_id)["messages"]
    assert [m["content"] for m in got] == ["another start"]
    assert got[0]["versions"]["ids"] == [u1, first["id"]]


def test_edit_needs_a_user_message_on_the_active_path(store, chat):
    conv_id, (u1, a1, u2, a2) = chat
    other = store.create_conversation(ALICE)
    theirs = store.add_user_message(ALICE, other["id"], "elsewhere")["id"]
    store.add_user_message(ALICE, conv_id, "new second", replaces=u2)
    for target in (a1, u2, theirs, "0" * 32, "nope"):  # answer, old branch, other conversation
        assert _code(store.add_user_message, ALICE, conv_id, "x", replaces=target) == "bad_message"
    assert store.add_user_message(BOB, conv_id, "x", replaces=u1) is None
    assert _path(store, conv_id) == ["first question", "first answer", "new second"]


def test_regenerate_adds_answer_versions(store, chat):
    conv_id, (u1, a1, u2, a2) = chat
    assert store.question_for(ALICE, conv_id, a1)["id"] == u1
    again = _answer(store, conv_id, "first answer, again", parent=u1)
    got = store.get_conversation(ALICE, conv_id)["messages"]
    assert [m["id"] for m in got] == [u1, again]
    assert got[1]["versions"] == {"index": 1, "count": 2, "ids": [a1, again]}
    assert _code(store.question_for, ALICE, conv_id, u1) == "bad_message"


def test_set_active_refuses_foreign_messages(store, chat):
    conv_id, ids = chat
    other = store.create_conversation(ALICE)
    theirs = store.add_user_message(ALICE, other["id"], "elsewhere")["id"]
    for bad in (theirs, "0" * 32, "x", 5):
        assert _code(store.set_active, ALICE, conv_id, bad) == "bad_message"
    assert store.set_active(BOB, conv_id, ids[0]) is None


@pytest.mark.parametrize("reason, ok", [("length", True), ("cancelled", True), ("timeout", True),
                                        ("shutdown", True), ("stop", False), ("error", False)])
def test_continuable(store, reason, ok):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = _answer(store, c["id"], "cut sh", reason)
    if ok:
        assert store.continuable(ALICE, c["id"])["id"] == mid
    else:
        assert _code(store.continuable, ALICE, c["id"]) == "bad_message"
    assert store.continuable(BOB, c["id"]) is None


def test_continue_extends_in_place_and_reindexes(store):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = _answer(store, c["id"], "the answer was cut", "length")
    store.reopen_assistant(mid)
    assert store.get_conversation(ALICE, c["id"])["messages"][-1]["status"] == "streaming"
    store.save_partial(mid, "the answer was cut short")
    store.finish_assistant(mid, "the answer was cut short on purpose", "stop")
    got = store.get_conversation(ALICE, c["id"])["messages"]
    assert len(got) == 2 and got[-1]["content"] == "the answer was cut short on purpose"
    assert [r["message_id"] for r in store.search(ALICE, "purpose")] == [mid]
    assert _code(store.continuable, ALICE, c["id"]) == "bad_message"


def test_continue_needs_an_answer_last(store, chat):
    conv_id, _ = chat
    store.add_user_message(ALICE, conv_id, "unanswered")
    assert _code(store.continuable, ALICE, conv_id) == "bad_message"


def test_interrupted_answers_can_be_continued(db_path):
    crashed = Store(db_path)
    c = crashed.create_conversation(ALICE)
    crashed.add_user_message(ALICE, c["id"], "q")
    mid = crashed.start_assistant(c["id"])
    crashed.save_partial(mid, "half")
    crashed.close()
    again = Store(db_path)
    try:
        assert again.continuable(ALICE, c["id"])["status"] == "interrupted"
    finally:
        again.close()


def test_attachments_are_stored_and_fenced_for_the_model(store):
    c = store.create_conversation(ALICE)
    files = [{"name": "notes.txt", "text": "line one\n```code```"}, {"name": "b.md", "text": "# B", "x": 1}]
    msg = store.add_user_message(ALICE, c["id"], "Summarize these.", files)
    got = store.get_conversation(ALICE, c["id"])["messages"][0]
    assert got["attachments"] == [{"name": "notes.txt", "text": "line one\n```code```"},
                                  {"name": "b.md", "text": "# B"}]
    assert msg["attachments"] == got["attachments"]
    assert store.history(c["id"]) == [{"role": "user", "content":
                                       "Summarize these.\n\nnotes.txt:\n````\nline one\n```code```\n````"
                                       "\n\nb.md:\n```\n# B\n```"}]
    assert "notes.txt:\n````\nline one" in store.export(ALICE, c["id"], "md")[0]
    assert json.loads(store.export(ALICE, c["id"], "json")[0])["messages"][0]["attachments"] == got["attachments"]


def test_versions_and_attachments_survive_a_restart(db_path):
    first = Store(db_path)
    c = first.create_conversation(ALICE)
    u1 = first.add_user_message(ALICE, c["id"], "q", [{"name": "f.txt", "text": "data"}])["id"]
    _answer(first, c["id"], "a1")
    u2 = first.add_user_message(ALICE, c["id"], "q2", [{"name": "g.txt", "text": "more"}], replaces=u1)["id"]
    before = first.get_conversation(ALICE, c["id"])
    first.close()
    second = Store(db_path)
    try:
        assert second.get_conversation(ALICE, c["id"]) == before
        assert [m["content"] for m in second.set_active(ALICE, c["id"], u1)["messages"]] == ["q", "a1"]
        assert before["messages"][0]["versions"]["ids"] == [u1, u2]
    finally:
        second.close()


def test_search_finds_own_messages_with_offsets(store, chat):
    conv_id, (u1, a1, u2, a2) = chat
    results = store.search(ALICE, "second")
    assert {r["message_id"] for r in results} == {u2, a2}
    for r in results:
        assert r["conversation_id"] == conv_id and r["title"] == "first question"
        assert [r["snippet"][s:e] for s, e in r["highlights"]] == ["second"]
    assert [r["message_id"] for r in store.search(ALICE, "seco")] != []  # the last word is a prefix
    assert [r["message_id"] for r in store.search(ALICE, "first answer")] == [a1]


def test_search_never_returns_another_clients_text(store, chat):
    theirs = store.create_conversation(BOB)
    store.add_user_message(BOB, theirs["id"], "bob's secret second plan")
    assert all(r["conversation_id"] == chat[0] for r in store.search(ALICE, "second"))
    assert store.search(ALICE, "secret") == []
    assert [r["snippet"] for r in store.search(BOB, "secret")] == ["bob's secret second plan"]
    assert store.search(None, "second") == [] and store.search("", "second") == []


@pytest.mark.parametrize("query", ['"', "AND", "*", "second OR", "NEAR(", "-first", "col:x", "", "   ", "'"])
def test_search_syntax_is_inert(store, chat, query):
    assert isinstance(store.search(ALICE, query), list)


def test_search_skips_streaming_text_and_deleted_conversations(store, chat):
    conv_id, _ = chat
    store.add_user_message(ALICE, conv_id, "third")
    mid = store.start_assistant(conv_id)
    store.save_partial(mid, "unfinished zebra")
    assert store.search(ALICE, "zebra") == []
    store.finish_assistant(mid, "finished zebra", "stop")
    assert [r["snippet"] for r in store.search(ALICE, "zebra")] == ["finished zebra"]
    store.delete(ALICE, conv_id)
    assert store.search(ALICE, "zebra") == [] and store.search(ALICE, "first") == []


def _strip(conv):
    """An export without what an import renews: ids, parents, update time, the title's mark."""
    out = {k: v for k, v in conv.items() if k not in ("id", "updated_at", "title", "tree", "active_id")}
    out["messages"] = [{k: v for k, v in m.items() if k not in ("id", "conversation_id", "parent_id", "versions")}
                       for m in conv["messages"]]
    return out


def test_import_of_an_export_round_trips(store, chat):
    conv_id, _ = chat
    store.add_user_message(ALICE, conv_id, "with a file", [{"name": "a.txt", "text": "A"}])
    _answer(store, conv_id, "cut", "cancelled")
    exported = json.loads(store.export(ALICE, conv_id, "json")[0])
    new_id = store.import_conversation(ALICE, exported, LIMIT)
    again = json.loads(store.export(ALICE, new_id, "json")[0])
    assert new_id != conv_id and _strip(again) == _strip(exported)
    assert [m["versions"]["count"] for m in again["messages"]] == [1] * 6
    assert again["title"] == exported["title"] + " (imported)"
    third = json.loads(store.export(ALICE, store.import_conversation(ALICE, again, LIMIT), "json")[0])
    assert _strip(third) == _strip(again)
    assert third["title"] == again["title"], "an import of an import is marked once"
    assert store.get_conversation(BOB, new_id) is None


def test_import_openai_messages(store):
    new_id = store.import_conversation(ALICE, {"messages": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"}]}, LIMIT)
    conv = store.get_conversation(ALICE, new_id)
    assert (conv["title"], conv["system"]) == ("Hi there (imported)", "Be kind.")
    assert [(m["role"], m["content"], m["status"]) for m in conv["messages"]] == [
        ("user", "Hi there", "complete"), ("assistant", "Hello!", "complete")]
    assert store.history(new_id)[0] == {"role": "system", "content": "Be kind."}


@pytest.mark.parametrize("body", [
    None, [], "x", {}, {"messages": "x"}, {"messages": [1]}, {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user"}, {"role": "system"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"title": 5, "messages": []}, {"title": "t" * 201, "messages": []}, {"system": 1, "messages": []},
    {"system": "a", "messages": [{"role": "system", "content": "b"}]},
    {"messages": [{"role": "assistant", "content": "x", "status": "weird"}]},
    {"messages": [{"role": "assistant", "content": "x", "reason": "because"}]},
    {"messages": [{"role": "user", "content": "x", "attachments": [{"name": "", "text": "x"}]}]},
    {"messages": [{"role": "user", "content": "x", "attachments": [{"name": "a", "text": "x"}] * 9}]},
    {"messages": [{"role": "user", "content": "x", "created_at": "yesterday"}]},
])
def test_import_rejects_malformed_bodies(store, body):
    assert _code(store.import_conversation, ALICE, body, LIMIT) == "bad_message"
    assert store.list_conversations(ALICE) == []


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x" * (LIMIT + 1)}]},
    {"messages": [{"role": "user", "content": "x" * 10, "attachments": [{"name": "a", "text": "y" * LIMIT}]}]},
    {"messages": [{"role": "user", "content": "x"}] * 5001},
    {"system": "s" * (LIMIT + 1), "messages": []},
])
def test_import_refuses_oversized_bodies(store, body):
    assert _code(store.import_conversation, ALICE, body, LIMIT) == "too_large"
    assert store.list_conversations(ALICE) == []


def test_import_counts_against_the_quotas(db_path):
    s = Store(db_path, max_conversations=1, max_messages=4)
    try:
        two = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        assert _code(s.import_conversation, ALICE, {"messages": [{"role": "user", "content": "q"}] * 5},
                     LIMIT) == "too_large"
        s.import_conversation(ALICE, two, LIMIT)
        assert _code(s.import_conversation, ALICE, two, LIMIT) == "too_large"
        assert len(s.list_conversations(ALICE)) == 1
        s.import_conversation(BOB, two, LIMIT)  # a quota per client
    finally:
        s.close()
