"""One contract, two implementations: the run registry and the limits behave the same whether they
are kept in this process (``chat.state.local_*``) or in a real redis-server (``chat.state.redis_*``)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from chat.config import Settings
from chat.engine import Generation, GenParams
from chat.engine.events import Done, Started
from chat.errors import ProtocolError
from chat.limits import Limits
from chat.runs import Run, RunRegistry
from chat.state import open_state

A, B = "198.51.100.7", "203.0.113.9"
ALICE, BOB, CAROL = "alice-0123456789abcd", "bob-0123456789abcdefg", "carol-0123456789abcde"
OPEN = {"rate_limit_per_min": 0, "rate_limit_per_ip_per_min": 0, "max_active_per_connection": 100,
        "max_active_per_ip": 0, "max_batch": 8}


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture(params=["local", "redis"])
def backend(request, tmp_path):
    """``make(**settings)``: a started state backend, as ``create_app`` picks it, of each kind."""
    url = ""
    if request.param == "redis":
        import redis
        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushall()
    made = []

    def make(**settings):
        state = open_state(Settings(**{**OPEN, "state_url": url, "data_dir": str(tmp_path), **settings}))
        state.start(SimpleNamespace(recover=lambda: 0))
        made.append(state)
        return state

    yield make
    for state in made:
        state.close()


def until(predicate, timeout: float = 10.0):
    """``predicate()``'s first true value, polled (releases in Redis come just after, from the hub)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def new_run(client: str, rid: str, conversation: str) -> Run:
    gen = Generation(messages=[{"role": "user", "content": "hi"}], params=GenParams())
    return Run(SimpleNamespace(), client, rid, conversation, "m-" + rid, gen, None)


# ---- the run registry

def test_one_request_at_a_time_per_conversation(backend):
    runs: RunRegistry = backend().runs
    assert not runs.busy("c1")
    assert runs.claim("c1", ALICE, "r1")
    assert runs.busy("c1") and not runs.busy("c2")
    assert not runs.claim("c1", ALICE, "r2")
    assert not runs.claim("c1", BOB, "r1")
    runs.unclaim("c1", ALICE, "r2")  # not the holder: nothing changes
    assert runs.busy("c1")
    runs.unclaim("c1", ALICE, "r1")
    assert not runs.busy("c1")
    assert runs.claim("c1", ALICE, "r2")


def test_a_run_is_found_until_forgotten(backend):
    runs: RunRegistry = backend().runs
    run = new_run(ALICE, "r1", "c1")
    assert runs.get(ALICE, "r1") is None and not runs.active(ALICE, "r1")
    assert runs.claim("c1", ALICE, "r1")
    runs.add(run)
    assert runs.get(ALICE, "r1") is run and runs.active(ALICE, "r1")
    assert runs.get(BOB, "r1") is None and not runs.active(BOB, "r1")  # ids are per client
    assert runs.all_active() == [run]
    assert not runs.followed(run)
    run.finished = True
    runs.release(run)
    assert not runs.busy("c1") and not runs.active(ALICE, "r1")
    assert runs.get(ALICE, "r1") is run  # still resumable during the grace
    assert runs.all_active() == []
    runs.forget(run)
    assert runs.get(ALICE, "r1") is None


def test_the_run_answering_in_a_conversation_is_named_to_its_client_only(backend):
    runs: RunRegistry = backend().runs
    run = new_run(ALICE, "r1", "c1")
    run.prefix = "Once upon"
    assert runs.answering(ALICE, "c1") is None
    assert runs.claim("c1", ALICE, "r1")
    runs.add(run)
    assert runs.answering(ALICE, "c1") == {"id": "r1", "message_id": "m-r1", "prefix_chars": 9}
    assert runs.answering(BOB, "c1") is None and runs.answering(ALICE, "c2") is None
    assert runs.answering_in(ALICE, ["c1", "c2"]) == {"c1"} and runs.answering_in(BOB, ["c1"]) == set()
    assert runs.answering_in(ALICE, []) == set()
    run.finished = True
    runs.release(run)
    assert runs.answering(ALICE, "c1") is None
    assert runs.answering_in(ALICE, ["c1"]) == set()


def test_a_handle_cancels_its_answer(backend):
    runs: RunRegistry = backend().runs
    run = new_run(ALICE, "r1", "c1")
    runs.add(run)
    handle = runs.get(ALICE, "r1")
    assert handle is not None and not handle.finished and not handle.wait(0)
    handle.cancel("cancelled")
    assert run.gen.cancel_reason == "cancelled"


# ---- the limits

def refused(limits: Limits, address: str, client: str | None = None) -> str:
    with pytest.raises(ProtocolError) as exc:
        limits.admit(address, client, "r")
    assert exc.value.id == "r"
    return exc.value.code


def tracked(limits: Limits, address: str, client: str | None = None) -> Generation:
    gen = Generation(messages=[], params=GenParams())
    limits.track(limits.admit(address, client), gen)
    return gen


def admitted_soon(limits: Limits, address: str, client: str | None = None) -> Generation:
    """Admit once the slot an answer just gave back is free (in Redis, a moment after its end)."""
    def attempt():
        try:
            return tracked(limits, address, client)
        except ProtocolError:
            return None
    gen = until(attempt)
    assert gen is not None, "the slot was never given back"
    return gen


def test_answers_count_per_client_and_address_until_they_end(backend):
    limits = backend(max_active_per_connection=2, max_active_per_ip=3).limits
    first, _ = tracked(limits, A, ALICE), tracked(limits, A, ALICE)
    assert refused(limits, A, ALICE) == "busy"  # the client, across connections
    tracked(limits, A, BOB)
    assert refused(limits, A, CAROL) == "busy"  # the address, across clients
    assert refused(limits, A) == "busy"  # /v1 from the same address
    tracked(limits, B, CAROL)  # another address is untouched
    first.emit(Started())
    first.emit(Done("stop"))
    admitted_soon(limits, A, ALICE)
    assert refused(limits, A, ALICE) == "busy"


def test_fresh_identities_share_their_address_rate(backend):
    limits = backend(rate_limit_per_min=3, rate_limit_per_ip_per_min=5).limits
    for i in range(3):  # three reconnects without a cookie: one budget
        limits.admit(A, f"anon:conn{i}").release()
    assert refused(limits, A, "anon:conn3") == "rate_limited"
    limits.admit(A, "cookie-one-0123456789").release()
    limits.admit(A, "cookie-two-0123456789").release()
    assert refused(limits, A, "cookie-three-012345678") == "rate_limited"  # new cookies: address budget
    limits.admit(B, "anon:elsewhere").release()


def test_connections_per_address(backend):
    limits = backend(max_connections_per_ip=2).limits
    for _ in range(2):
        assert limits.connection_allowed(A)
        limits.connect(A)
    assert not limits.connection_allowed(A)
    assert limits.connection_allowed(B)
    limits.disconnect(A)
    assert limits.connection_allowed(A)


def test_fair_share_while_others_wait(backend):
    limits = backend(max_batch=4).limits
    for gen in [tracked(limits, A, f"hog-{i}-0123456789abc") for i in range(4)]:
        gen.emit(Started())
    tracked(limits, A, "hog-4-0123456789abc")  # nobody else waits: the queue is open to it
    waiting = tracked(limits, B, "guest-0123456789abcd")  # queued behind the hog
    assert refused(limits, A, "hog-5-0123456789abc") == "overloaded"
    waiting.emit(Started())  # the guest got its slot: the hog may queue again
    admitted_soon(limits, A, "hog-5-0123456789abc")


def test_two_workers_count_together_only_in_redis(backend, request):
    one, two = backend(max_active_per_ip=1).limits, backend(max_active_per_ip=1).limits
    tracked(one, A, ALICE)
    if request.node.callspec.params["backend"] == "redis":
        assert refused(two, A, BOB) == "busy"
    else:  # each process counts its own
        tracked(two, A, BOB)
