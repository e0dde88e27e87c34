"""The StoreBackend contract (chat/store/backend.py), run against SQLite and PostgreSQL (conftest.db_backend):
what the Store relies on from either database, checked on the backend itself."""
import threading
import time

import pytest

from chat.errors import SearchTimeout
from chat.store.backend import marks
from chat.store.conversations import backend_for, new_id

ALICE = "alice-client-0123456789"


@pytest.fixture
def backend(db_path):
    b = backend_for(db_path)
    b.migrate()
    yield b
    b.close()


def add_conversation(db, client: str = ALICE) -> str:
    conv_id = new_id()
    db.execute(f"INSERT INTO conversations (id, client_id, title, created_at, updated_at) VALUES ({marks(db, 5)})",
               (conv_id, client, "t", time.time(), time.time()))
    return conv_id


def add_message(db, conv_id: str, content: str, status: str = "complete") -> str:
    message_id = new_id()
    db.execute(f"INSERT INTO messages (id, conversation_id, role, content, status, created_at)"
               f" VALUES ({marks(db, 6)})", (message_id, conv_id, "user", content, status, time.time()))
    db.reindex(message_id)
    return message_id


def test_what_it_says_about_itself(backend, db_backend):
    assert backend.kind == db_backend
    assert isinstance(backend.other_hosts, bool)
    assert backend.schema_version == len(backend.migrations) > 0
    backend.migrate()  # a second start finds the schema current
    assert backend.schema_version == len(backend.migrations)


@pytest.mark.parametrize("value", ["plain", "why? 100% {braces} 'quotes' \"double\"", "中文 😀", "", None, 42, 2.5])
def test_values_come_back_as_they_went_in(backend, value):
    with backend.connection() as db:
        row = db.execute(f"SELECT {db.mark} AS v", (value,)).fetchone()
    assert row["v"] == value and row[0] == value


def test_a_question_mark_in_the_sql_is_no_parameter(backend):
    # The SQL is the dialect's own: nothing rewrites a ``?`` in a literal into a parameter.
    with backend.connection() as db:
        row = db.execute(f"SELECT 'why?' AS q, {db.mark} AS v", ("x",)).fetchone()
    assert (row["q"], row["v"]) == ("why?", "x")


def test_rows_by_name_position_and_iteration(backend):
    with backend.connection() as db:
        conv_id = add_conversation(db)
        rows = db.execute(f"SELECT id, client_id FROM conversations WHERE id = {db.mark}", (conv_id,)).fetchall()
        assert [(r["id"], r[1]) for r in rows] == [(conv_id, ALICE)]
        assert [r["client_id"] for r in db.execute("SELECT client_id FROM conversations")] == [ALICE]
        assert db.execute(f"SELECT id FROM conversations WHERE id = {db.mark}", ("none",)).fetchone() is None


def test_row_counts_and_executemany(backend):
    with backend.connection() as db:
        ids = [add_conversation(db) for _ in range(3)]
        db.executemany(f"UPDATE conversations SET title = {db.mark} WHERE id = {db.mark}",
                       [(f"title {i}", conv_id) for i, conv_id in enumerate(ids)])
        assert sorted(r["title"] for r in db.execute("SELECT title FROM conversations")) == \
            ["title 0", "title 1", "title 2"]
        assert db.execute(f"DELETE FROM conversations WHERE id = {db.mark}", (ids[0],)).rowcount == 1
        assert db.execute(f"DELETE FROM conversations WHERE id = {db.mark}", (ids[0],)).rowcount == 0


def test_a_transaction_commits_or_rolls_back_whole(backend):
    with backend.connection() as db:
        with db.transaction():
            kept = add_conversation(db)
        with pytest.raises(RuntimeError), db.transaction():
            add_conversation(db)
            raise RuntimeError("changed my mind")
        assert [r["id"] for r in db.execute("SELECT id FROM conversations")] == [kept]


def test_a_failed_statement_leaves_the_backend_usable(backend):
    with pytest.raises(Exception, match="nowhere"), backend.connection() as db:
        db.execute("SELECT * FROM nowhere")
    with backend.connection() as db:
        assert db.execute("SELECT count(*) FROM conversations").fetchone()[0] == 0


def test_rows_read_for_update_and_a_named_lock_in_a_transaction(backend):
    with backend.connection() as db, db.transaction():
        conv_id = add_conversation(db)
        db.lock(ALICE)
        row = db.execute(f"SELECT id FROM conversations WHERE id = {db.mark}" + db.lock_rows, (conv_id,)).fetchone()
        assert row["id"] == conv_id


def test_check_then_insert_under_a_lock_holds_across_writers(backend):
    """What the Store's quotas rely on: writers that count, then insert, under one named lock never
    both see the same count."""
    seen, errors = [], []

    def writer() -> None:
        try:
            with backend.connection() as db, db.transaction():
                db.lock("quota")
                count = db.execute(f"SELECT count(*) FROM conversations WHERE client_id = {db.mark}",
                                   (ALICE,)).fetchone()[0]
                time.sleep(0.01)  # widen the window between the check and the insert
                add_conversation(db)
                seen.append(count)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(seen) == list(range(6))


def test_finished_messages_are_found_and_streaming_ones_are_not(backend):
    with backend.connection() as db:
        conv_id = add_conversation(db)
        found = add_message(db, conv_id, "the aardvark reads 中文介绍")
        add_message(db, conv_id, "an aardvark still typing", status="streaming")
        db.reindex(new_id())  # a message that does not exist: nothing happens
    deadline = time.monotonic() + 10
    for text in ("aardvark", "aard", "中文", "aardvark 介绍"):
        assert [r["message_id"] for r in backend.search(ALICE, text, deadline)] == [found], text
    assert backend.search("someone-else-0123456789", "aardvark", deadline) == []
    assert backend.search(ALICE, "   ", deadline) == []


def test_a_search_past_its_deadline_raises(backend):
    with backend.connection() as db:
        add_message(db, add_conversation(db), "aardvark")
    with pytest.raises(SearchTimeout):
        backend.search(ALICE, "aardvark", time.monotonic() - 1)


def test_only_a_full_disk_is_full(backend):
    assert not backend.is_full(RuntimeError("disk is full"))
    with pytest.raises(Exception) as failed, backend.connection() as db:
        db.execute("SELECT * FROM nowhere")
    assert not backend.is_full(failed.value)


def test_closed_means_closed(db_path):
    backend = backend_for(db_path)
    backend.migrate()
    backend.close()
    with pytest.raises(Exception, match="(?i)closed"), backend.connection() as db:
        db.execute("SELECT 1")
