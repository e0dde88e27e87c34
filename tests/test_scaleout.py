"""Scaled out for real: an engine process, two web instances of two gevent workers each (remote
backend, shared Redis, PostgreSQL), round-robin nginx in front with no stickiness."""
from __future__ import annotations

import json
import signal

import pytest
from helpers import (
    ROOT,
    WS,
    cancel_and_stop_from_the_other,
    conv_of,
    conversation,
    cookie_for,
    http_get,
    resume_after_forced_drops,
    text_of,
    wait_for,
    wait_settled,
)
from services import Nginx

LONG = {"temperature": 0.8, "seed": 5, "max_new_tokens": 4000}
RATE = 12  # chats per client per minute on the web tier


@pytest.fixture(scope="module")
def cluster(server_factory, redis_server, postgres):
    """(engine, [web a, web b], web env) sharing Redis and one PostgreSQL database."""
    engine = server_factory("engine", CHAT_ENGINE_ONLY=1, CHAT_MAX_NEW_TOKENS=4096, CHAT_CONTEXT_TOKENS=8192,
                            CHAT_MAX_BATCH=8)
    db = postgres.new_schema()
    env = dict(CHAT_BACKEND="openai", CHAT_BACKEND_URL=engine.url + "/v1", CHAT_WORKERS=2,
               CHAT_STATE_URL=redis_server.url, CHAT_DB=str(db), CHAT_MAX_NEW_TOKENS=4096,
               CHAT_RESUME_GRACE_S=3, CHAT_MAX_ACTIVE_PER_CONNECTION=8, CHAT_RATE_LIMIT_PER_MIN=RATE,
               CHAT_TRUSTED_PROXIES=1)
    webs = [server_factory(f"web-{name}", **env) for name in "ab"]
    return engine, webs, env


@pytest.fixture(scope="module")
def nginx(cluster, tmp_path_factory):
    """deploy/nginx-scaleout.conf, round robin over the two web instances."""
    _, webs, _ = cluster
    proxy = Nginx(tmp_path_factory.mktemp("nginx"), ROOT / "deploy" / "nginx-scaleout.conf",
                  [web.port for web in webs])
    yield proxy
    proxy.stop()


def test_metrics_count_every_worker_of_an_instance(cluster):
    """/metrics on whichever worker answers sums both workers (prometheus multiprocess files)."""
    _, (a, _), _ = cluster

    def sample(name):
        body = http_get(a.url + "/metrics")[2].decode()
        return float(next((line.split()[1] for line in body.splitlines() if line.startswith(name + " ")), 0))

    open_before = sample("chat_ws_connections")
    sockets = [WS(a.ws_url) for _ in range(6)]  # gunicorn spreads them over its two workers
    assert wait_for(lambda: all(sample("chat_ws_connections") == open_before + 6 for _ in range(4)), 10)
    done_before = sample('chat_generations_total{reason="length"}')
    for i, s in enumerate(sockets):
        assert s.chat("count", rid=f"m{i}", params={"max_new_tokens": 2})[-1]["reason"] == "length"
    assert wait_for(lambda: all(sample('chat_generations_total{reason="length"}') == done_before + 6
                                for _ in range(4)), 10)
    for s in sockets:
        s.close()
    assert wait_for(lambda: all(sample("chat_ws_connections") == open_before for _ in range(4)), 10)


def test_through_nginx_a_resumed_answer_loses_and_repeats_nothing(nginx):
    resume_after_forced_drops(nginx)


def test_through_nginx_the_sidebar_and_chats_work_on_any_instance(nginx):
    cookie = cookie_for(nginx)
    convs = []
    for i in range(4):  # four sockets, round robin over two instances of two workers each
        client = WS(nginx.ws_url, cookie=cookie)
        convs.append(conv_of(client.chat(f"hello {i}", rid=f"n{i}", params={"max_new_tokens": 3})))
        client.close()
    for _ in range(4):
        status, _, body = http_get(nginx.url + "/api/conversations", headers={"Cookie": cookie})
        listed = {c["id"] for c in json.loads(body)}
        assert status == 200 and set(convs) <= listed


def engine_active(engine) -> float:
    body = http_get(engine.url + "/metrics")[2].decode()
    return float(next(line.split()[1] for line in body.splitlines()
                      if line.startswith("chat_active_generations ")))


def test_resume_on_the_other_instance_loses_and_repeats_nothing(cluster):
    _, (a, b), _ = cluster
    resume_after_forced_drops(a, [b])


def test_cancel_and_stop_from_the_other_instance(cluster):
    engine, (a, b), _ = cluster
    cancel_and_stop_from_the_other(a, b)
    assert wait_for(lambda: engine_active(engine) == 0, 10), "the engine kept generating"


def test_the_rate_limit_holds_across_instances(cluster):
    _, (a, b), _ = cluster
    cookie = cookie_for(a)
    sockets = [WS(a.ws_url, cookie=cookie), WS(b.ws_url, cookie=cookie)]
    outcomes = []
    for i in range(RATE + 1):
        frames = sockets[i % 2].chat("hi", rid=f"q{i}", params={"max_new_tokens": 1})
        outcomes.append(frames[-1].get("code") or frames[-1]["type"])
    assert outcomes[:RATE] == ["done"] * RATE and outcomes[RATE] == "rate_limited", outcomes
    for s in sockets:
        s.close()


def test_killing_an_instance_mid_answer_keeps_the_conversation_consistent(cluster, server_factory):
    _, (a, b), env = cluster
    doomed = server_factory("web-doomed", **env)
    cookie = cookie_for(doomed)
    client = WS(doomed.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "k", "content": "go", "params": LONG})
    frames = client.until(lambda f: f["type"] == "delta" and f["index"] >= 20)
    conv = conv_of(frames)
    assert wait_for(lambda: conversation(b, cookie, conv)[1]["messages"][-1]["content"], 10), "no checkpoint"
    doomed.stop(signal.SIGKILL)
    received = text_of(frames)
    status, data = conversation(b, cookie, conv)
    assert status == 200 and data["messages"][-1]["content"]
    # a socket that resumes on a live instance gets the replay, then an end once the owner is known dead
    again = WS(a.ws_url, cookie=cookie, timeout=120)  # the end comes once the owner is known dead (~20 s)
    again.send({"type": "resume", "id": "k", "from": 0})
    replay = again.until(lambda f: f["type"] == "done")
    assert text_of(replay).startswith(received) and replay[-1]["reason"] == "error"
    assert wait_for(lambda: conversation(b, cookie, conv)[1]["messages"][-1]["status"] == "interrupted", 90)
    stored = conversation(b, cookie, conv)[1]["messages"][-1]["content"]
    assert stored and text_of(replay).startswith(stored)
    again.close()


def beating(redis_server, servers) -> bool:
    """Whether every worker of ``servers`` has its heartbeat key (chat:alive:<host>:<pid>) in Redis."""
    import redis
    pids = {key.decode().rsplit(":", 1)[-1] for key in redis.Redis.from_url(redis_server.url).keys("chat:alive:*")}
    return all(str(worker.pid) in pids for srv in servers for worker in srv.workers())


def test_redis_restarted_mid_answer_loses_nothing(cluster, redis_server):
    _, (a, b), _ = cluster
    cookie = cookie_for(a)
    client = WS(a.ws_url, cookie=cookie)
    client.send({"type": "chat", "id": "rr", "content": "go", "params": {**LONG, "max_new_tokens": 300}})
    frames = client.until(lambda f: f["type"] == "delta" and f["index"] >= 5)
    redis_server.restart()
    frames += client.until(lambda f: f.get("id") == "rr" and f["type"] == "done")
    assert frames[-1]["reason"] == "length"
    stored = wait_settled(a, cookie, conv_of(frames))["messages"][-1]
    assert stored["content"] == text_of(frames) and stored["status"] == "complete"
    assert wait_for(lambda: beating(redis_server, (a, b)), 10), "the heartbeats did not put every worker back"
    after = WS(b.ws_url, cookie=cookie).chat("still there?", rid="after", params={"max_new_tokens": 3})
    assert after[-1]["type"] == "done"
