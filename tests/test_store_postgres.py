"""What only PostgreSQL has: several processes and hosts on one database, gevent around psycopg,
and the whole app (HTTP and WebSocket) on it."""
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from fakes import AppServer, FakeEngine
from helpers import WS, conv_of, cookie_for, http_get, text_of, wait_settled

from chat import create_app
from chat.config import Settings
from chat.store import Store, open_store

ROOT = Path(__file__).resolve().parent.parent
ALICE = "alice-client-0123456789"


@pytest.fixture
def url(postgres) -> str:
    return postgres.new_schema()


def _streaming(store, owner: str) -> str:
    """A conversation whose answer is streaming, written by ``owner``."""
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "q")
    mid = store.start_assistant(c["id"])
    with store._conn() as db:
        db.execute("UPDATE messages SET owner = %s WHERE id = %s", (owner, mid))
    return c["id"]


def _status(store, conv_id) -> str:
    return store.get_conversation(ALICE, conv_id)["messages"][-1]["status"]


def test_processes_starting_together_migrate_once(url):
    stores, errors = [], []

    def start():
        try:
            stores.append(Store(url))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == [] and len(stores) == 6
        assert {s.schema_version for s in stores} == {len(stores[0].migrations)}
        with stores[0]._conn() as db:
            assert db.execute("SELECT count(*) FROM schema_version").fetchone()[0] == 1
    finally:
        for s in stores:
            s.close()


def test_recover_leaves_other_hosts_answers_alone(url):
    store = Store(url)
    theirs = _streaming(store, "other-host:4242:" + "a" * 32)
    dead_here = _streaming(store, store._owner.rsplit(":", 1)[0] + ":" + "b" * 32)  # this process, closed
    assert store.recover() == 1
    assert (_status(store, theirs), _status(store, dead_here)) == ("streaming", "interrupted")
    store.close()


def test_recover_asks_the_injected_liveness_once_per_owner(url):
    asked = []

    def alive(owner):
        asked.append(owner)
        return owner != "other-host:1:dead"

    store = open_store(Settings(db=url), alive=alive)
    gone = [_streaming(store, "other-host:1:dead") for _ in range(2)]
    live = _streaming(store, "other-host:2:live")
    asked.clear()
    assert store.recover() == 2 and sorted(asked) == ["other-host:1:dead", "other-host:2:live"]
    assert [_status(store, c) for c in gone + [live]] == ["interrupted", "interrupted", "streaming"]
    assert store.recover() == 0  # cheap to repeat: nothing left to do
    store.close()


def test_text_with_nul_is_stored(url):
    store = Store(url)
    c = store.create_conversation(ALICE)
    store.add_user_message(ALICE, c["id"], "a\x00b")  # PostgreSQL text cannot hold NUL
    assert store.get_conversation(ALICE, c["id"])["messages"][0]["content"] == "a\ufffdb"
    store.close()


GEVENT_SCRIPT = textwrap.dedent("""
    import sys
    if sys.argv[2] == "psycopg-first":  # psycopg then chose its C wait, blind to gevent
        import psycopg
    from gevent import monkey; monkey.patch_all()
    import json, time, gevent
    from gevent import get_hub
    from chat.store import Store

    store = Store(sys.argv[1])
    ticks = []

    def ticker():  # a /healthz-like greenlet: it must keep running during the query
        while True:
            ticks.append(time.perf_counter())
            gevent.sleep(0.01)

    def slow():
        with store._conn() as db:
            db.execute("SELECT pg_sleep(0.5)")

    gevent.spawn(ticker)
    gevent.sleep(0.05)
    out = {}
    for name, run in (("greenlet", lambda: gevent.spawn(slow).get(timeout=30)),
                      ("thread", lambda: get_hub().threadpool.spawn(slow).get(timeout=30))):
        start = time.perf_counter()
        run()
        end = time.perf_counter()
        during = [t for t in ticks if start <= t <= end]
        gaps = [b - a for a, b in zip(during, during[1:])]
        out[name] = {"query_s": round(end - start, 3), "ticks": len(during),
                     "max_gap_ms": round(1000 * max(gaps, default=end - start), 1)}
    print(json.dumps(out))
""")


@pytest.mark.parametrize("order", ["patch-first", "psycopg-first"])
def test_a_slow_query_does_not_stop_the_hub(url, order):
    done = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT, url, order], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    print(result)
    # Blocked, the ticker would not run at all during the 0.5 s query (one tick at most).
    assert result["greenlet"]["ticks"] >= 5 and result["thread"]["ticks"] >= 5, result


def test_app_on_postgresql(url, tmp_path):
    settings = Settings(db=url, data_dir=str(tmp_path), rate_limit_per_min=0, rate_limit_per_ip_per_min=0,
                        max_active_per_ip=0)
    app = create_app(settings, engine=FakeEngine())
    server = AppServer(app)
    try:
        assert app.extensions["chat"].store.kind == "postgresql"
        cookie = cookie_for(server)
        client = WS(server.ws_url, cookie=cookie)
        frames = client.chat("Tell me about zebras")
        client.close()
        conv, answer = conv_of(frames), text_of(frames)
        stored = wait_settled(server, cookie, conv)
        assert [m["content"] for m in stored["messages"]] == ["Tell me about zebras", answer]
        status, _, body = http_get(f"{server.url}/api/conversations", headers={"Cookie": cookie})
        assert status == 200 and [c["id"] for c in json.loads(body)] == [conv]
        status, _, body = http_get(f"{server.url}/api/search?q=zebra", headers={"Cookie": cookie})
        (hit,) = json.loads(body)["results"]
        assert hit["conversation_id"] == conv and [hit["snippet"][s:e] for s, e in hit["highlights"]] == ["zebras"]
        status, _, body = http_get(f"{server.url}/api/conversations/{conv}/export?format=md",
                                   headers={"Cookie": cookie})
        assert status == 200 and b"## User\n\nTell me about zebras" in body
        stranger = http_get(f"{server.url}/api/search?q=zebra", headers={"Cookie": cookie_for(server)})
        assert json.loads(stranger[2]) == {"results": []}
    finally:
        app.extensions["chat"].engine.shutdown()
        server.close()
        app.extensions["chat"].store.close()
