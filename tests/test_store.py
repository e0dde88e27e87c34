"""The conversation store on SQLite and PostgreSQL (each test runs on both, see conftest.db_backend):
schema, ownership, streaming checkpoints, recovery, concurrency."""
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from chat.errors import ProtocolError
from chat.store import MIGRATIONS, Store

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"


SQLITE_ONLY = pytest.mark.parametrize("db_backend", ["sqlite"])


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


@pytest.fixture
def conv(store):
    """A conversation of ALICE with one finished exchange."""
    c = store.create_conversation(ALICE, system="Be brief.")
    store.add_user_message(ALICE, c["id"], "Hello?")
    mid = store.start_assistant(c["id"])
    store.finish_assistant(mid, "Hi.", "stop", {"prompt_tokens": 5, "completion_tokens": 2},
                           {"ttft_ms": 10.0, "total_ms": 20.0, "tokens_per_s": 100.0})
    return c


def test_schema_is_current(store, db_backend):
    assert store.kind == db_backend
    assert store.schema_version == len(store.migrations) > 0
    assert store.migrations is MIGRATIONS or db_backend == "postgresql"


@SQLITE_ONLY
def test_creates_parent_dirs_and_wal(store, db_path):
    assert Path(db_path).exists()
    assert Path(f"{db_path}-wal").exists()


def test_reopen_keeps_data_and_schema(store, db_path, conv):
    store.close()
    again = Store(db_path)
    try:
        assert again.schema_version == len(again.migrations)
        assert [m["content"] for m in again.get_conversation(ALICE, conv["id"])["messages"]] == ["Hello?", "Hi."]
    finally:
        again.close()


def test_memory_database():
    s = Store(":memory:")
    c = s.create_conversation(ALICE)
    assert s.get_conversation(ALICE, c["id"])["messages"] == []
    s.close()


def test_conversation_round_trip(store, conv):
    got = store.get_conversation(ALICE, conv["id"])
    assert {k: got[k] for k in ("id", "system", "created_at")} == {k: conv[k] for k in ("id", "system", "created_at")}
    assert got["updated_at"] >= conv["updated_at"]
    user, answer = got["messages"]
    assert user["role"] == "user" and user["status"] == "complete" and user["reason"] is None
    assert answer == {
        "id": answer["id"], "conversation_id": conv["id"], "role": "assistant", "content": "Hi.",
        "status": "complete", "reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        "timings": {"ttft_ms": 10.0, "total_ms": 20.0, "tokens_per_s": 100.0},
        "created_at": answer["created_at"], "parent_id": user["id"], "attachments": [],
        "versions": {"index": 0, "count": 1, "ids": [answer["id"]]}}
    assert user["parent_id"] is None


def test_ids_are_random_hex(store):
    ids = {store.create_conversation(ALICE)["id"] for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


@pytest.mark.parametrize("content, title", [
    ("What is WAL mode?", "What is WAL mode?"),
    ("  spaced\n\n  out\ttext  ", "spaced out text"),
    ("word " * 30, "word word word word word word word word word word word…"),
    ("x" * 100, "x" * 59 + "…"),
])
def test_title_defaults_from_first_user_message(store, content, title):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], content)
    store.add_user_message(ALICE, c["id"], "a later message")
    got = store.get_conversation(ALICE, c["id"])["title"]
    assert got == title and len(got) <= 60


@pytest.mark.parametrize("named_by", ["create", "rename"])
def test_given_title_is_kept(store, named_by):
    c = store.create_conversation(ALICE, title="Mine" if named_by == "create" else None)
    if named_by == "rename":
        assert store.rename(ALICE, c["id"], "Mine")
    store.add_user_message(ALICE, c["id"], "first message")
    assert store.get_conversation(ALICE, c["id"])["title"] == "Mine"


def test_list_newest_first_without_messages(store):
    first = store.create_conversation(ALICE)
    second = store.create_conversation(ALICE)
    assert [c["id"] for c in store.list_conversations(ALICE)] == [second["id"], first["id"]]
    store.add_user_message(ALICE, first["id"], "bump")
    listed = store.list_conversations(ALICE)
    assert [c["id"] for c in listed] == [first["id"], second["id"]]
    assert all("messages" not in c for c in listed)


def test_clients_are_isolated(store, conv):
    assert store.list_conversations(BOB) == []
    assert store.get_conversation(BOB, conv["id"]) is None
    assert store.owns(BOB, conv["id"]) is False
    assert store.rename(BOB, conv["id"], "stolen") is False
    assert store.add_user_message(BOB, conv["id"], "hi") is None
    assert store.question_for(BOB, conv["id"]) is None
    assert store.export(BOB, conv["id"], "json") is None
    assert store.delete(BOB, conv["id"]) is False
    got = store.get_conversation(ALICE, conv["id"])
    assert got["title"] == "Hello?" and len(got["messages"]) == 2


@pytest.mark.parametrize("bad_id", [
    None, 42, "", "nope", "0" * 31, "0" * 33, "A" * 32, "../../etc/passwd",
    "' OR '1'='1", "0" * 32 + "\n", "0" * 32 + "/x",
])
def test_malformed_ids_are_not_found(store, conv, bad_id):
    assert store.get_conversation(ALICE, bad_id) is None
    assert store.owns(ALICE, bad_id) is False
    assert store.rename(ALICE, bad_id, "t") is False
    assert store.delete(ALICE, bad_id) is False
    assert store.add_user_message(ALICE, bad_id, "hi") is None
    assert store.question_for(ALICE, bad_id) is None
    assert store.export(ALICE, bad_id, "md") is None


@pytest.mark.parametrize("client", [None, ""])
def test_missing_client_sees_nothing(store, conv, client):
    assert store.list_conversations(client) == []
    assert store.get_conversation(client, conv["id"]) is None
    assert store.delete(client, conv["id"]) is False


def test_unknown_id_is_not_found(store):
    assert store.get_conversation(ALICE, "0" * 32) is None
    assert store.delete(ALICE, "0" * 32) is False


def test_delete_cascades_to_messages(store, conv):
    assert store.delete(ALICE, conv["id"]) is True
    assert store.get_conversation(ALICE, conv["id"]) is None
    assert store.history(conv["id"]) == []
    assert store.list_conversations(ALICE) == []


@pytest.mark.parametrize("reason, status", [
    ("stop", "complete"), ("length", "complete"), ("cancelled", "partial"),
    ("timeout", "partial"), ("shutdown", "partial"), ("error", "partial"),
])
def test_finish_status_follows_reason(store, reason, status):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = store.start_assistant(c["id"])
    store.finish_assistant(mid, "partial answ", reason, {"prompt_tokens": 1, "completion_tokens": 3}, {})
    answer = store.get_conversation(ALICE, c["id"])["messages"][-1]
    assert (answer["id"], answer["status"], answer["reason"]) == (mid, status, reason)
    assert answer["content"] == "partial answ"


def test_streaming_checkpoints(store):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = store.start_assistant(c["id"])
    answer = store.get_conversation(ALICE, c["id"])["messages"][-1]
    assert (answer["status"], answer["content"]) == ("streaming", "")
    store.save_partial(mid, "Hel")
    store.save_partial(mid, "Hello")
    assert store.get_conversation(ALICE, c["id"])["messages"][-1]["content"] == "Hello"
    store.finish_assistant(mid, "Hello!", "stop", {}, {})
    store.save_partial(mid, "late checkpoint")
    assert store.get_conversation(ALICE, c["id"])["messages"][-1]["content"] == "Hello!"


def _streaming(store):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = store.start_assistant(c["id"])
    store.save_partial(mid, "half an ans")
    return c["id"]


def test_recover_after_crash_keeps_partial_text(db_path):
    crashed = Store(db_path)
    conv_id = _streaming(crashed)
    crashed.close()  # the process died: nobody finishes the answer
    restarted = Store(db_path)
    try:
        answer = restarted.get_conversation(ALICE, conv_id)["messages"][-1]
        assert (answer["status"], answer["reason"], answer["content"]) == ("interrupted", "error", "half an ans")
        assert restarted.recover() == 0
        assert restarted.history(conv_id)[-1] == {"role": "assistant", "content": "half an ans"}
    finally:
        restarted.close()


def test_recover_counts_and_spares_open_stores(db_path):
    live = Store(db_path)
    conv_id = _streaming(live)
    other = Store(db_path)
    try:
        assert other.get_conversation(ALICE, conv_id)["messages"][-1]["status"] == "streaming"
        live.close()
        assert other.recover() == 1
        assert other.get_conversation(ALICE, conv_id)["messages"][-1]["status"] == "interrupted"
    finally:
        other.close()


@pytest.mark.parametrize("owner_alive, status", [(True, "streaming"), (False, "interrupted")])
def test_recover_spares_live_sibling_process(db_path, monkeypatch, owner_alive, status):
    if owner_alive:
        pid = os.getppid()
    else:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        pid = dead.pid
    sibling = Store(db_path)
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: pid)
        conv_id = _streaming(sibling)
    sibling.close()
    restarted = Store(db_path)
    try:
        assert restarted.get_conversation(ALICE, conv_id)["messages"][-1]["status"] == status
    finally:
        restarted.close()


def test_question_for_regenerate_keeps_the_old_answer(store, conv):
    user = store.question_for(ALICE, conv["id"])
    assert (user["role"], user["content"]) == ("user", "Hello?")
    first = store.get_conversation(ALICE, conv["id"])["messages"][1]["id"]
    second = store.start_assistant(conv["id"], user["id"])
    store.finish_assistant(second, "Hello.", "stop")
    answer = store.get_conversation(ALICE, conv["id"])["messages"][1]
    assert (answer["id"], answer["content"]) == (second, "Hello.")
    assert answer["versions"] == {"index": 1, "count": 2, "ids": [first, second]}
    assert store.question_for(ALICE, conv["id"], second)["id"] == user["id"]
    with pytest.raises(ProtocolError) as err:  # the old answer is on another branch now
        store.question_for(ALICE, conv["id"], first)
    assert err.value.code == "bad_message"


def test_question_for_without_user_message(store):
    c = store.create_conversation(ALICE)
    with pytest.raises(ProtocolError) as err:
        store.question_for(ALICE, c["id"])
    assert err.value.code == "bad_message"


def test_history(store, conv):
    store.add_user_message(ALICE, conv["id"], "Again?")
    empty = store.start_assistant(conv["id"])
    assert store.history(conv["id"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]
    store.finish_assistant(empty, "", "cancelled", {}, {})
    assert store.history(conv["id"])[-1] == {"role": "user", "content": "Again?"}


def test_history_limit_loads_only_the_newest_messages(store, conv):
    store.add_user_message(ALICE, conv["id"], "Again?")
    assert store.history(conv["id"], limit=2) == [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]


def test_history_without_system(store):
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "hi")
    assert store.history(c["id"]) == [{"role": "user", "content": "hi"}]


def test_export_json(store, conv):
    body, mimetype, filename = store.export(ALICE, conv["id"], "json")
    assert mimetype == "application/json"
    assert filename == f"hello-{conv['id'][:8]}.json"
    exported, shown = json.loads(body), store.get_conversation(ALICE, conv["id"])
    tree, active = exported.pop("tree"), exported.pop("active_id")
    assert exported == shown
    assert active == shown["messages"][-1]["id"]
    assert tree == [{k: v for k, v in m.items() if k not in ("conversation_id", "versions")}
                    for m in shown["messages"]]


def test_export_markdown(store, conv):
    mid = store.start_assistant(conv["id"])
    store.finish_assistant(mid, "Cut sh", "cancelled", {}, {})
    body, mimetype, filename = store.export(ALICE, conv["id"], "md")
    assert mimetype == "text/markdown" and filename.endswith(".md")
    assert body.startswith("# Hello?\n")
    for part in ("**System:** Be brief.", "## User\n\nHello?", "## Assistant\n\nHi.", "Cut sh",
                 "_(incomplete answer: cancelled)_"):
        assert part in body


@pytest.mark.parametrize("title, stem", [
    ("Crème brûlée / recipe?", "creme-brulee-recipe"),
    ("日本語", "conversation"),
    ("a" * 80, "a" * 50),
])
def test_export_filename_is_ascii(store, title, stem):
    c = store.create_conversation(ALICE, title=title)
    assert store.export(ALICE, c["id"], "md")[2] == f"{stem}-{c['id'][:8]}.md"


def test_export_rejects_unknown_format(store, conv):
    with pytest.raises(ValueError):
        store.export(ALICE, conv["id"], "pdf")


def _hammer(store, client, rounds, errors, barrier):
    try:
        barrier.wait()
        c = store.create_conversation(client)
        for i in range(rounds):
            store.add_user_message(client, c["id"], f"q{i}")
            store.history(c["id"])
            mid = store.start_assistant(c["id"])
            for n in range(3):
                store.save_partial(mid, "a" * n)
            store.finish_assistant(mid, f"a{i}", "stop", {"completion_tokens": i}, {})
            store.list_conversations(client)
    except Exception as exc:  # any failure in a thread fails the test below
        errors.append(exc)


@pytest.mark.parametrize("connections", [1, 2])
def test_concurrent_writers(db_path, connections):
    stores = [Store(db_path) for _ in range(connections)]
    errors, rounds = [], 15
    barrier = threading.Barrier(8)
    threads = [threading.Thread(target=_hammer, args=(stores[i % connections], f"client-{i:020d}", rounds,
                                                      errors, barrier)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        for i in range(8):
            (c,) = stores[0].list_conversations(f"client-{i:020d}")
            messages = stores[0].get_conversation(f"client-{i:020d}", c["id"])["messages"]
            assert len(messages) == 2 * rounds and all(m["status"] == "complete" for m in messages)
    finally:
        for s in stores:
            s.close()


GEVENT_SCRIPT = textwrap.dedent("""
    from gevent import monkey; monkey.patch_all()
    import sys, gevent
    from gevent import get_hub
    from chat.store import Store

    store = Store(sys.argv[1])

    def work(n):
        c = store.create_conversation(f"client-{n:020d}")
        for i in range(10):
            store.add_user_message(f"client-{n:020d}", c["id"], "q")
            mid = store.start_assistant(c["id"])
            store.save_partial(mid, "a")
            store.finish_assistant(mid, "ab", "stop", {}, {})
            gevent.sleep(0)
        return len(store.get_conversation(f"client-{n:020d}", c["id"])["messages"])

    pool = get_hub().threadpool
    jobs = [gevent.spawn(work, n) for n in range(8)] + [pool.spawn(work, n) for n in range(8, 12)]
    results = [j.get(timeout=60) for j in jobs]
    assert results == [20] * 12, results
    print("ok")
""")


def test_safe_from_greenlets_and_real_threads_under_gevent(tmp_path):
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT, str(tmp_path / "g.db")], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
