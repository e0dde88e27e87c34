"""Bounded storage: per-client quotas, a full disk refused without losing anything, expiry
(on SQLite and PostgreSQL, see conftest.db_backend)."""
import threading
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


def squeeze(store, room_bytes: int | None = None) -> None:
    """Let the database hold little more: SQLite's max_page_count (its own "database or disk is
    full"); on PostgreSQL a trigger raising SQLSTATE 53100 disk_full, the server's error for a
    file it cannot extend, once the stored text would pass ``room_bytes`` (default: no room)."""
    with store._conn() as db:
        if store.kind == "sqlite":
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            db.execute(f"PRAGMA max_page_count = {pages + (room_bytes or 0) // 4096}")
            return
        used = db.execute("SELECT coalesce(sum(octet_length(content)), 0) FROM messages").fetchone()[0]
        db.execute(f"""CREATE OR REPLACE FUNCTION full_disk() RETURNS trigger AS $$ BEGIN
            IF (SELECT coalesce(sum(octet_length(content)), 0) FROM messages)
               + octet_length(NEW.content) > {used + (room_bytes or 0)} THEN
              RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = 'disk_full';
            END IF; RETURN NEW; END $$ LANGUAGE plpgsql""")
        db.execute("CREATE TRIGGER full_disk BEFORE INSERT OR UPDATE ON messages"
                   " FOR EACH ROW EXECUTE FUNCTION full_disk()")


def test_conversation_quota_per_client(db_path):
    store = Store(db_path, max_conversations=2)
    for _ in range(2):
        store.create_conversation(ALICE)
    with pytest.raises(ProtocolError) as refused:
        store.create_conversation(ALICE)
    assert refused.value.code == "too_large" and "delete some" in refused.value.message
    store.create_conversation(BOB)  # one client's quota is not another's
    store.delete(ALICE, store.list_conversations(ALICE)[0]["id"])
    store.create_conversation(ALICE)
    assert len(store.list_conversations(ALICE)) == 2
    store.close()


def test_quota_holds_for_writers_in_several_processes(db_path):
    stores = [Store(db_path, max_conversations=3) for _ in range(4)]  # a connection each, as processes
    made, refused = [], []
    barrier = threading.Barrier(12)

    def create(i):
        barrier.wait()
        try:
            made.append(stores[i % 4].create_conversation(ALICE))
        except ProtocolError:
            refused.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert (len(made), len(refused)) == (3, 9)
    assert len(stores[0].list_conversations(ALICE)) == 3
    for s in stores:
        s.close()


def test_message_cap_per_conversation(db_path):
    store = Store(db_path, max_messages=4)
    conv = store.create_conversation(ALICE)
    exchange(store, ALICE, conv["id"], "one")
    exchange(store, ALICE, conv["id"], "two")
    with pytest.raises(ProtocolError) as refused:
        store.add_user_message(ALICE, conv["id"], "three")
    assert refused.value.code == "too_large" and "start a new conversation" in refused.value.message
    assert [m["content"] for m in store.get_conversation(ALICE, conv["id"])["messages"]] == \
        ["one", "answer to one", "two", "answer to two"]
    store.close()


def test_full_disk_refuses_writes_and_keeps_what_is_stored(db_path, db_backend):
    store = Store(db_path, max_mb=1)  # max_mb: SQLite's only; PostgreSQL gets the trigger below
    if db_backend == "postgresql":
        squeeze(store, 2**20)
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
    if db_backend == "sqlite":
        with store._conn() as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    for conv in store.list_conversations(BOB):  # freeing space makes room again
        store.delete(BOB, conv["id"])
    exchange(store, ALICE, kept["id"], "after")
    store.close()
    reopened = Store(db_path)
    texts = [m["content"] for m in reopened.get_conversation(ALICE, kept["id"])["messages"]]
    assert texts[:2] == ["precious", "answer to precious"] and "after" in texts
    reopened.close()


def test_a_full_disk_mid_transaction_rolls_back_cleanly(db_path, db_backend):
    store = Store(db_path)
    conv = store.create_conversation(ALICE)
    exchange(store, ALICE, conv["id"], "kept")
    squeeze(store)
    with pytest.raises(StorageFull):
        store.add_user_message(ALICE, conv["id"], "y" * 50_000)  # BEGIN ... INSERT fails
    if db_backend == "sqlite":
        assert not store._backend.raw.in_transaction
    else:  # the connection went back to the pool idle, not stuck in the failed transaction
        idle = [raw.info.transaction_status.name for raw in store._backend._idle]
        assert idle and set(idle) == {"IDLE"}
    got = store.get_conversation(ALICE, conv["id"])
    assert [m["content"] for m in got["messages"]] == ["kept", "answer to kept"]
    store.close()


def test_forget_and_expire_clients(db_path):
    store = Store(db_path)
    old = store.create_conversation("anon:old-connection-0123")
    exchange(store, "anon:old-connection-0123", old["id"])
    store.create_conversation("anon:live-connection-012")
    store.create_conversation("anonymous-looking-cookie")  # a cookie id, not the anon: namespace
    with store._conn() as db:
        db.execute(f"UPDATE conversations SET updated_at = {db.mark} WHERE id = {db.mark}",
                   (time.time() - 7200, old["id"]))
    assert store.expire_clients("anon:", 3600) == 1
    assert store.forget_client("anon:live-connection-012") == 1
    with store._conn() as db:
        assert [r[0] for r in db.execute("SELECT client_id FROM conversations")] == ["anonymous-looking-cookie"]
        assert db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascaded
    store.close()


def test_other_database_errors_are_not_disguised(db_path):
    store = Store(db_path)
    with store._conn() as db:
        db.execute("ALTER TABLE messages RENAME TO gone")
    conv = store.create_conversation(ALICE)
    with pytest.raises(Exception) as failed:
        store.add_user_message(ALICE, conv["id"], "hi")
    assert not isinstance(failed.value, StorageFull) and "messages" in str(failed.value)
    store.close()
