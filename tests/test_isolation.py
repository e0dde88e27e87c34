"""One request cannot end everyone's answers: parameters checked the same on every transport, and an
engine step that one row cannot fail (issue 33, item 1)."""
from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request

import pytest
from helpers import WS, ask, collect, events_of, make_engine

from chat import params as sampling
from chat.engine import Delta, Done, GenParams, Refused
from chat.engine.model.sampling import sample

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("isolation"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def live(engine, app_factory):
    """The whole app in this process around the real engine on the tiny model."""
    return app_factory(engine=engine)


def post(srv, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{srv.url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def running(engine, text="keep going"):
    """A long greedy answer already streaming."""
    gen = engine.submit(ask(text), GenParams(temperature=0, max_new_tokens=100_000))
    assert any(isinstance(e, Delta) for e in _until_delta(gen))
    return gen


def _until_delta(gen):
    while True:
        event = gen.next_event(60)
        assert event is not None and not isinstance(event, Done), event
        yield event
        if isinstance(event, Delta):
            return


def still_streams(gen, deltas: int = 5) -> None:
    """``gen`` goes on making text; then it is cancelled and ends ``cancelled``."""
    for _ in range(deltas):
        event = gen.next_event(60)
        assert isinstance(event, Delta), event
    gen.cancel()
    assert events_of(gen, 60)[-1].reason == "cancelled"


@pytest.mark.parametrize("field,value", [
    ("top_k", 9223372036854775808), ("top_k", 2 ** 64), ("top_k", 10 ** 7), ("top_k", -2),
    ("temperature", 2.5), ("top_p", 0), ("min_p", 1.5), ("seed", 2 ** 64), ("seed", -(2 ** 63) - 1),
])
def test_v1_refuses_out_of_range_params_and_running_answers_go_on(live, engine, field, value):
    gen = running(engine)
    status, body = post(live, {"messages": [{"role": "user", "content": "hi"}], field: value, "max_tokens": 3})
    assert status == 400, body
    assert body["error"]["code"] == "invalid_value" and body["error"]["param"] == field
    still_streams(gen)


def test_top_k_above_the_vocabulary_is_refused_on_both_transports(live, engine):
    vocab = engine.vocab_size
    assert vocab and vocab < 1_000_000
    status, body = post(live, {"messages": [{"role": "user", "content": "hi"}], "top_k": vocab + 1})
    assert status == 400 and body["error"]["param"] == "top_k" and str(vocab) in body["error"]["message"]
    status, _ = post(live, {"messages": [{"role": "user", "content": "hi"}], "top_k": vocab, "max_tokens": 2})
    assert status == 200
    ws = WS(live.ws_url)
    try:
        ws.send({"type": "chat", "id": "k", "content": "hi", "params": {"top_k": vocab + 1}})
        frame = ws.until(lambda f: f["type"] in ("error", "done"))[-1]
        assert frame["type"] == "error" and frame["code"] == "bad_message" and str(vocab) in frame["message"]
    finally:
        ws.close()


def test_v1_minus_one_top_k_still_means_off(live):
    status, body = post(live, {"messages": [{"role": "user", "content": "hi"}], "top_k": -1, "max_tokens": 2})
    assert status == 200, body


def test_one_shared_rule_table():
    """The /v1 checks are the WebSocket's: the same table answers for both."""
    assert sampling.problem({"top_k": 9223372036854775808}) == "params.top_k must be an integer from 0 (off) to 1000000"
    assert sampling.problem({"top_k": 50}, vocab=40) == "params.top_k must be an integer from 0 (off) to 40"
    assert sampling.problem({"top_k": 40}, vocab=40) is None


@pytest.mark.parametrize("bad", [
    GenParams(temperature=float("nan")), GenParams(temperature=float("inf")), GenParams(temperature=-1.0),
    GenParams(temperature=0.7, top_p=float("nan")), GenParams(temperature=0.7, min_p=-1.0),
    GenParams(temperature=0.7, top_k=-5),
], ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}-m{p.min_p}")
def test_bad_parameters_in_the_engine_are_refused_alone(engine, bad):
    """Parameters that slipped past the edges refuse that answer with a clear error; the rest go on."""
    gen = running(engine, "bystander")
    end = events_of(engine.submit(ask("victim"), bad), 60)[-1]
    assert isinstance(end, Refused) and end.code == "bad_message" and end.message, end
    still_streams(gen)


def test_a_top_k_past_the_vocabulary_in_the_engine_means_off(engine):
    """What /v1 sent before the fix (2**63) reaches the sampler as 'off': the same draw, no overflow."""
    gen = running(engine, "bystander")
    huge = GenParams(temperature=0.7, top_k=9223372036854775808, seed=5, max_new_tokens=8)
    off = GenParams(temperature=0.7, top_k=0, seed=5, max_new_tokens=8)
    assert collect(engine.submit(ask("victim"), huge))[1][-1].reason == "length"
    still_streams(gen)
    logits = torch.randn(3, engine.vocab_size)
    draws = [sample(logits, [p] * 3, [torch.Generator().manual_seed(i) for i in range(3)]) for p in (huge, off)]
    assert draws[0] == draws[1]


def test_sampling_that_fails_mid_batch_ends_only_that_row(engine, monkeypatch):
    """A row whose draw raises (here: its generator broken) ends with done error and a message."""
    gen = running(engine, "bystander two")
    victim = engine.submit(ask("victim two"), GenParams(temperature=0.8, max_new_tokens=100_000))
    list(_until_delta(victim))

    class Broken:
        def get_state(self):
            return torch.Generator().get_state()

        def set_state(self, state):
            pass

    broken = threading.Event()

    def breaker():  # the engine thread's own slot list: swap the victim's generator there
        for slot in engine.batch.rows:
            if slot.gen is victim:
                slot.generator = Broken()
                broken.set()
    engine.queue.wake.set()
    breaker()
    assert broken.is_set()
    end = events_of(victim, 60)[-1]
    assert isinstance(end, Done) and end.reason == "error" and "sampling" in end.notice
    still_streams(gen)


def test_tiny_temperatures_are_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    for t in (1e-300, 1e-30, 5e-324, 1e-9):
        params = [GenParams(temperature=t), GenParams(temperature=t, top_k=2, top_p=0.5)]
        assert sample(logits, params, gens) == [1, 0]
    assert not math.isnan(sample(logits * 0 + float("nan"), [GenParams(temperature=0.7)], gens[:1])[0])


def test_a_tiny_temperature_gives_the_greedy_answer(engine):
    greedy = collect(engine.submit(ask("hello there"), GenParams(temperature=0, max_new_tokens=20)))[0]
    tiny = collect(engine.submit(ask("hello there"), GenParams(temperature=1e-300, max_new_tokens=20)))[0]
    assert tiny == greedy
