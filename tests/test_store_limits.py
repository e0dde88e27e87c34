"""Bounded storage: per-client quotas, a full disk refused without losing anything, expiry."""
import sqlite3
import time

import pytest

from chat.errors import ProtocolError, StorageFull
from chat.store import Store

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"


def exchange(store, client, conv_id, text="hello"):
    """One question and its finished answer."""
    store.add_user_message(client, conv_id, text)
    mid = store.start_assistant(conv_id)
    store.finish_assistant(mid, "answer to " + text[:20], "stop")
    return mid


def test_conversation_quota_per_client(tmp_path):
    store = Store(tmp_path / "q.db", max_conversations=2)
    for _ in range(2):
        store.create_conversation(ALICE)
    with pytest.raises(ProtocolError) as refused:
        store.create_conversation(ALICE)
    assert refused.value.code == "too_large" and "delete some" in refused.value.message
    store.create_conversation(BOB)  # one client's quota is not another's
    store.delete(ALICE, store.list_conversations(ALICE)[0]["id"])
    store.create_conversation(ALICE)
    assert len(store.list_conversations(ALICE)) == 2


def test_message_cap_per_conversation(tmp_path):
    store = Store(tmp_path / "m.db", max_messages=4)
    conv = store.create_conversation(ALICE)
    exchange(store, ALICE, conv["id"], "one")
    exchange(store, ALICE, conv["id"], "two")
    with pytest.raises(ProtocolError) as refused:
        store.add_user_message(ALICE, conv["id"], "three")
    assert refused.value.code == "too_large" and "start a new conversation" in refused.value.message
    assert [m["content"] for m in store.get_conversation(ALICE, conv["id"])["messages"]] == \
        ["one", "answer to one", "two", "answer to two"]


def test_full_disk_refuses_writes_and_keeps_what_is_stored(tmp_path):
    path = tmp_path / "full.db"
    store = Store(path, max_mb=1)  # PRAGMA max_page_count: SQLite's own "database or disk is full"
    kept = store.create_conversation(ALICE)
    exchange(store, ALICE, kept["id"], "precious")
    big = "x" * 100_000
    with pytest.raises(StorageFull) as full:
        for _ in range(40):
            conv = store.create_conversation(BOB)
            store.add_user_message(BOB, conv["id"], big)
    assert full.value.code == "overloaded" and "storage is full" in full.value.message
    before = store.get_conversation(ALICE, kept["id"])
    for attempt in (lambda: store.add_user_message(ALICE, kept["id"], big),
                    lambda: store.save_partial(store.start_assistant(kept["id"]), big)):
        try:
            attempt()
        except StorageFull:
            pass
    assert store.get_conversation(ALICE, kept["id"])["messages"][:2] == before["messages"][:2]
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    for conv in store.list_conversations(BOB):  # freeing space makes room again
        store.delete(BOB, conv["id"])
    exchange(store, ALICE, kept["id"], "after")
    store.close()
    reopened = Store(path)
    texts = [m["content"] for m in reopened.get_conversation(ALICE, kept["id"])["messages"]]
    assert texts[:2] == ["precious", "answer to precious"] and "after" in texts
    reopened.close()


def test_a_full_disk_mid_transaction_rolls_back_cleanly(tmp_path):
    store = Store(tmp_path / "t.db", max_mb=1)
    conv = store.create_conversation(ALICE)
    store._db.execute(f"PRAGMA max_page_count = {store._db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(StorageFull):
        store.add_user_message(ALICE, conv["id"], "y" * 50_000)  # BEGIN IMMEDIATE ... INSERT fails
    assert not store._db.in_transaction
    assert store.get_conversation(ALICE, conv["id"])["messages"] == []


def test_forget_and_expire_clients(tmp_path):
    store = Store(tmp_path / "e.db")
    old = store.create_conversation("anon:old-connection-0123")
    exchange(store, "anon:old-connection-0123", old["id"])
    store.create_conversation("anon:live-connection-012")
    store.create_conversation("anonymous-looking-cookie")  # a cookie id, not the anon: namespace
    store._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (time.time() - 7200, old["id"]))
    assert store.expire_clients("anon:", 3600) == 1
    assert store.forget_client("anon:live-connection-012") == 1
    assert [r[0] for r in store._db.execute("SELECT client_id FROM conversations")] == ["anonymous-looking-cookie"]
    assert store._db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_other_sqlite_errors_are_not_disguised(tmp_path):
    store = Store(tmp_path / "o.db")
    store._db.execute("DROP TABLE messages")
    conv = store.create_conversation(ALICE)
    with pytest.raises(sqlite3.OperationalError):
        store.add_user_message(ALICE, conv["id"], "hi")
