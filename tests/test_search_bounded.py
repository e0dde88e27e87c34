"""Search in every language and at a bounded cost, on SQLite and on PostgreSQL: CJK words inside
sentences, highlights at the right offsets, snippets cut from a window, a time budget, and
databases of older schemas migrated."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from chat.errors import SearchTimeout
from chat.store import Store, pg_schema, schema
from chat.store.search import INDEXED_CHARS, parse
from chat.store.snippets import SNIPPET_CHARS, fold

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"
CHINESE = "你好，请用中文介绍一下你自己"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def _conversation(store, *texts, client=ALICE) -> list[str]:
    """A conversation of ``client``: the texts as alternating question and answer; their ids."""
    conv = store.create_conversation(client)["id"]
    ids = []
    for i, text in enumerate(texts):
        if i % 2 == 0:
            ids.append(store.add_user_message(client, conv, text)["id"])
        else:
            mid = store.start_assistant(conv)
            store.finish_assistant(mid, text, "stop")
            ids.append(mid)
    return ids


def _marked(result) -> list[str]:
    return [result["snippet"][a:b] for a, b in result["highlights"]]


@pytest.mark.parametrize("query, marked", [
    ("介绍", ["介绍"]), ("中文", ["中文"]), ("你好", ["你好"]), ("中文介绍", ["中文介绍"]),
    ("己", ["己"]), ("介绍 你好", ["你好", "介绍"]),
])
def test_cjk_words_inside_a_sentence_are_found_and_marked(store, query, marked):
    [mid] = _conversation(store, CHINESE)
    _conversation(store, "unrelated words only")
    results = store.search(ALICE, query)
    assert [r["message_id"] for r in results] == [mid]
    assert _marked(results[0]) == marked
    assert results[0]["snippet"] == CHINESE


def test_cjk_runs_must_occur_whole(store):
    _conversation(store, CHINESE)
    assert store.search(ALICE, "绍你") == []  # both characters occur, never next to each other
    assert store.search(ALICE, "中介") == []


def test_japanese_korean_and_mixed_queries(store):
    ja, ko = _conversation(store, "日本語のテキストです。", "안녕하세요 세계, hello Python")
    assert [r["message_id"] for r in store.search(ALICE, "テキスト")] == [ja]
    result = store.search(ALICE, "하세요 pyth")
    assert [r["message_id"] for r in result] == [ko] and _marked(result[0]) == ["하세요", "Python"]
    assert store.search(ALICE, "テキスト python") == []  # every part must match the same message


def test_cjk_results_are_ranked_and_private(store):
    once = _conversation(store, "我们讨论了很多事情，其中也提到了中文。" * 3)[0]
    often = _conversation(store, "中文，中文，还是中文。")[0]
    _conversation(store, "中文 of someone else", client=BOB)
    assert [r["message_id"] for r in store.search(ALICE, "中文")] == [often, once]
    assert len(store.search(BOB, "中文")) == 1


def test_latin_words_fold_case_with_correct_offsets(store, db_backend):
    _conversation(store, "Héllo wörld, the Café is open.")
    [result] = store.search(ALICE, "HÉLLO café")
    assert _marked(result) == ["Héllo", "Café"]
    [result] = store.search(ALICE, "the ca")  # the last word as typed: a prefix
    assert _marked(result) == ["the", "Café"]
    if db_backend == "sqlite":  # FTS5 folds accents too (PostgreSQL's 'simple' does not)
        [result] = store.search(ALICE, "hello cafe")
        assert _marked(result) == ["Héllo", "Café"]


def test_snippets_are_cut_from_a_window_of_a_huge_message(store):
    words = [f"w{i}" for i in range(400_000)]  # ~2.7 MB of distinct words
    words[5000] = "needle"
    [mid] = _conversation(store, "question", " ".join(words))[1:]
    t0 = time.monotonic()
    [result] = store.search(ALICE, "needle")
    assert time.monotonic() - t0 < 5
    assert result["message_id"] == mid
    assert len(result["snippet"]) <= SNIPPET_CHARS + 2
    assert result["snippet"].startswith("…") and result["snippet"].endswith("…")
    assert _marked(result) == ["needle"]
    words[5000], words[-10] = "w5000", "beyond"  # past the indexed part: not indexed, not searched
    _conversation(store, "question", " ".join(words))
    assert len(" ".join(words[:-10])) > INDEXED_CHARS and store.search(ALICE, "beyond") == []


SLOW = {"sqlite": "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT max(i) FROM n",
        "postgresql": "SELECT pg_sleep(30)"}


def test_a_search_past_its_deadline_is_stopped(store, db_backend, monkeypatch):
    _conversation(store, "alpha beta")
    with pytest.raises(SearchTimeout):
        store.search(ALICE, "alpha", deadline=time.monotonic() - 1)  # it waited for its turn that long

    def slow(db, *args):
        return db.execute(SLOW[db_backend]).fetchall()

    monkeypatch.setattr("chat.store.search.search", slow)  # a query that would run for ever
    t0 = time.monotonic()
    with pytest.raises(SearchTimeout):
        store.search(ALICE, "alpha", deadline=t0 + 0.3)
    assert time.monotonic() - t0 < 3
    monkeypatch.undo()
    assert len(store.search(ALICE, "alpha")) == 1  # the store is fine afterwards


def test_queries_without_words(store):
    _conversation(store, "some text")
    for text in ("", "   ", "___", "!!! ???", "\"* OR NEAR("):
        assert store.search(ALICE, text) == []
    assert parse("a_b") is not None and parse("___") is None


def test_folding_keeps_every_offset():
    text = "ÀÉÎõü İstanbul ß Ǆ ﬁ 中文 😀 Ωmega"
    assert len(fold(text)) == len(text)
    assert fold("ÀÉÎõü Ωmega").startswith("aeiou ωmega")


def _old_sqlite(path, versions: int):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    for statements in schema.MIGRATIONS[:versions]:
        for statement in statements:
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {versions}")
    return db


def _old_postgres(url, versions: int):
    import psycopg
    db = psycopg.connect(url, autocommit=True)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (%s)", (versions,))
    for statements in pg_schema.MIGRATIONS[:versions]:
        for statement in statements:
            db.execute(statement.replace("%", "%%"), ())
    return db


def test_older_databases_are_migrated_and_their_cjk_text_found(db_backend, db_path):
    """A database of the schema before CJK search (SQLite 3, PostgreSQL 2) with stored messages."""
    if db_backend == "sqlite":
        old, mark = _old_sqlite(db_path, 3), "?"
    else:
        old, mark = _old_postgres(db_path, 2), "%s"
    values = ", ".join([mark] * 7)
    old.execute(f"INSERT INTO conversations (id, client_id, title, title_set, created_at, updated_at, active_id)"
                f" VALUES ({values})", ("c" * 32, ALICE, "T", 1, 1.0, 1.0, "2" * 32))
    for mid, parent, role, content in (("1" * 32, None, "user", CHINESE),
                                       ("2" * 32, "1" * 32, "assistant", "我叫小助手，很高兴认识你 hello")):
        old.execute(f"INSERT INTO messages (id, conversation_id, parent_id, role, content, status, created_at)"
                    f" VALUES ({', '.join([mark] * 7)})", (mid, "c" * 32, parent, role, content, "complete", 2.0))
    old.close()
    store = Store(db_path)
    try:
        assert store.schema_version == len(store.migrations)
        assert [r["message_id"] for r in store.search(ALICE, "介绍")] == ["1" * 32]
        assert [r["message_id"] for r in store.search(ALICE, "认识")] == ["2" * 32]
        assert [r["message_id"] for r in store.search(ALICE, "hello")] == ["2" * 32]
        [new] = _conversation(store, "新的中文消息")
        assert {r["message_id"] for r in store.search(ALICE, "中文")} == {"1" * 32, new}
    finally:
        store.close()


def test_continued_and_deleted_answers_leave_the_cjk_index(store):
    conv = store.create_conversation(ALICE)["id"]
    store.add_user_message(ALICE, conv, "question")
    mid = store.start_assistant(conv)
    store.finish_assistant(mid, "第一部分", "length")
    assert [r["message_id"] for r in store.search(ALICE, "部分")] == [mid]
    store.finish_assistant(mid, "第一部分，然后继续", "stop")  # the continued answer, reindexed
    assert [r["message_id"] for r in store.search(ALICE, "继续")] == [mid]
    assert store.delete(ALICE, conv)
    assert store.search(ALICE, "部分") == [] and store.search(ALICE, "继续") == []
