"""Shared state in a real redis-server: two apps (two workers, as far as they can tell) share runs,
busy conversations and limits; losing Redis refuses new requests but not running answers."""
from __future__ import annotations

import time

import pytest
from fakes import AppServer, FakeEngine
from helpers import (
    WS,
    cancel_and_stop_from_the_other,
    conv_of,
    cookie_for,
    finished_answer_resumes,
    one_of_two_sockets_leaves,
    resume_after_forced_drops,
    text_of,
    two_sockets_follow_one_answer,
    wait_settled,
)

LONG = {"temperature": 0.8, "seed": 5, "max_new_tokens": 4000}


@pytest.fixture
def pair(redis_server, tmp_path):
    """Two apps on one database and one Redis, like two workers; settings apply to both."""
    import redis

    from chat import create_app
    from chat.config import Settings
    from chat.store import Store
    redis.Redis.from_url(redis_server.url).flushall()
    servers = []

    def start(**settings):
        settings = {"max_new_tokens": 4096, "context_tokens": 8192, "resume_grace_s": 2,
                    "rate_limit_per_min": 0, "rate_limit_per_ip_per_min": 0, "max_active_per_ip": 0,
                    "max_active_per_connection": 8, "data_dir": str(tmp_path), "state_url": redis_server.url,
                    **settings}
        for _ in range(2):
            engine = FakeEngine(answer_words=100_000, delay=0.002, seeded=True)
            store = Store(tmp_path / "chat.db")
            servers.append(AppServer(create_app(Settings(**settings), engine=engine, store=store)))
        return servers

    yield start
    for srv in servers:
        srv.state.engine.shutdown()
        srv.state.state_backend.close()
        srv.close()


def test_resume_on_the_other_worker_loses_and_repeats_nothing(pair):
    a, b = pair()
    resume_after_forced_drops(a, [b])


def test_a_finished_answer_resumes_from_the_other_worker(pair):
    a, b = pair()
    finished_answer_resumes(a, b)


def test_sockets_on_two_workers_follow_one_answer(pair):
    a, b = pair()
    two_sockets_follow_one_answer(a, b)
    one_of_two_sockets_leaves(a, b)


def test_cancel_and_stop_reach_the_worker_that_runs_the_answer(pair):
    a, b = pair()
    cancel_and_stop_from_the_other(a, b)
    assert not a.state.turns.runs.all_active()


def test_busy_and_duplicate_ids_hold_across_workers(pair):
    a, b = pair()
    cookie = cookie_for(a)
    first = WS(a.ws_url, cookie=cookie)
    first.send({"type": "chat", "id": "one", "content": "go", "params": LONG})
    conv = first.until(lambda f: f["type"] == "start")[-1]["conversation_id"]
    second = WS(b.ws_url, cookie=cookie)
    assert second.chat("more", rid="two", conversation_id=conv)[-1]["code"] == "busy"
    assert second.chat("other", rid="one")[-1]["code"] == "duplicate_id"
    first.send({"type": "cancel", "id": "one"})
    first.until(lambda f: f["type"] == "done")
    follow = second.chat("more", rid="three", conversation_id=conv, params={"max_new_tokens": 3})
    assert follow[-1]["type"] == "done" and conv_of(follow) == conv
    first.close()
    second.close()


def test_limits_count_requests_on_every_worker(pair):
    a, b = pair(rate_limit_per_min=2, max_active_per_connection=1)
    cookie = cookie_for(a)
    one, two = WS(a.ws_url, cookie=cookie), WS(b.ws_url, cookie=cookie)
    one.send({"type": "chat", "id": "r1", "content": "go", "params": LONG})
    one.until(lambda f: f["type"] == "start")
    assert two.chat("x", rid="r2")[-1]["code"] == "busy"  # one answer at once for this client
    one.send({"type": "cancel", "id": "r1"})
    one.until(lambda f: f["type"] == "done")
    for _ in range(50):  # the release reaches Redis from the engine's thread, soon after done
        frames = two.chat("x", rid="r3", params={"max_new_tokens": 2})
        if frames[-1]["type"] == "done":
            break
        time.sleep(0.05)
    assert frames[-1]["type"] == "done"
    for _ in range(50):  # r3's release, too, reaches Redis just after its done (call_soon on the hub)
        code = one.chat("x", rid="r4")[-1].get("code")
        if code != "busy":
            break
        time.sleep(0.05)
    assert code == "rate_limited"  # 2 per minute, spent on both workers
    one.close()
    two.close()


def test_losing_redis_refuses_new_requests_and_keeps_running_answers(pair, redis_server):
    a, b = pair()
    cookie = cookie_for(a)
    client = WS(a.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "running", "content": "go",
                 "params": {**LONG, "max_new_tokens": 300}})
    frames = client.until(lambda f: f["type"] == "delta")
    redis_server.stop()
    try:
        refused = client.chat("new", rid="new")
        assert refused[-1]["type"] == "error" and refused[-1]["code"] == "overloaded"
        assert "shared state" in refused[-1]["message"]
        frames += refused[:-1] + client.until(lambda f: f.get("id") == "running" and f["type"] == "done")
    finally:
        redis_server.start()
    assert frames[-1]["reason"] == "length"
    deltas = [f["index"] for f in frames if f["type"] == "delta"]
    assert deltas == list(range(len(deltas))) and len(deltas) > 100
    stored = wait_settled(a, cookie, conv_of(frames))["messages"][-1]
    assert stored["content"] == text_of(frames) and stored["status"] == "complete"
    again = client.chat("back", rid="back", params={"max_new_tokens": 3})
    assert again[-1]["type"] == "done"
    client.close()


def test_per_address_limits_count_on_every_worker(pair):
    a, b = pair(max_active_per_ip=1, max_connections_per_ip=2)
    one = WS(a.ws_url, cookie=cookie_for(a))
    one.send({"type": "chat", "id": "r1", "content": "go", "params": LONG})
    one.until(lambda f: f["type"] == "start")
    two = WS(b.ws_url, cookie=cookie_for(b))  # another client, same address
    assert two.chat("x", rid="r2")[-1]["code"] == "busy"
    with pytest.raises(Exception) as refused:  # a third socket from this address, on either worker
        WS(a.ws_url)
    assert getattr(refused.value, "status_code", None) == 429
    one.close()
    two.close()


def test_a_dead_workers_counts_lapse_with_its_lease(redis_server):
    import redis

    from chat.config import Settings
    from chat.state.redis_state import RedisState as SharedState
    redis.Redis.from_url(redis_server.url).flushall()
    settings = Settings(state_url=redis_server.url, max_active_per_ip=1, rate_limit_per_ip_per_min=0)
    dead, alive = SharedState(settings), SharedState(settings)
    dead.limits.lease_s = alive.limits.lease_s = 1
    dead.limits.admit("10.0.0.1")  # never released, and no heartbeat renews it: the worker "died"
    with pytest.raises(Exception) as err:
        alive.limits.admit("10.0.0.1")
    assert err.value.code == "busy"
    time.sleep(1.2)
    alive.limits.admit("10.0.0.1").release()
