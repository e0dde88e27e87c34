"""Chunked prefill between decode steps: same answers as one-shot prefill, running rows keep moving."""
from __future__ import annotations

import pytest
from helpers import QUESTIONS, ask, collect, in_threads, make_engine

from chat.engine import Delta, GenParams

GREEDY = GenParams(temperature=0, max_new_tokens=24)
LONG = "please summarise the following notes carefully: " + "the committee met and argued at length. " * 30


@pytest.fixture(scope="module")
def chunked(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("chunked"), prefill_chunk=7)
    yield eng
    eng.shutdown()


def busy(eng):
    """A long greedy answer that keeps the batch decoding, so newcomers are prefilled in chunks."""
    gen = eng.submit(ask("keep going"), GenParams(temperature=0, max_new_tokens=4000))
    next(e for e in gen if isinstance(e, Delta))
    return gen


def test_chunked_prefill_gives_the_one_shot_answers(chunked):
    prompts = QUESTIONS + [LONG]
    alone = [collect(chunked.submit(ask(q), GREEDY))[0] for q in prompts]  # nobody decoding: one shot
    running = busy(chunked)
    gens = [chunked.submit(ask(q), GREEDY) for q in prompts]  # prompts of different lengths share chunks
    together = [collect(g)[0] for g in gens]
    running.cancel()
    collect(running)
    assert together == alone


def test_chunked_prefill_after_a_prefix_hit_gives_the_fresh_answer(chunked):
    history = ask("first question about chunked prefix reuse")
    first, _ = collect(chunked.submit(history, GREEDY, key="conv-chunk"))
    turn2 = history + [{"role": "assistant", "content": first}, {"role": "user", "content": LONG}]
    fresh, _ = collect(chunked.submit(turn2, GREEDY))
    running = busy(chunked)
    reused_text, events = collect(chunked.submit(turn2, GREEDY, key="conv-chunk"))
    running.cancel()
    collect(running)
    assert events[-1].reused_tokens > 0
    assert reused_text == fresh


def test_decode_steps_run_between_chunks_of_a_long_prompt(chunked):
    """Between two decode steps of the running batch, at most CHAT_PREFILL_CHUNK prompt tokens go in."""
    calls = []  # (is a decode step of the batch, tokens fed)
    real = chunked.runner.forward

    def spy(input_ids, kv, positions, spans=None):
        calls.append((kv is chunked.batch.kv, input_ids.numel()))
        return real(input_ids, kv, positions, spans)

    running = busy(chunked)
    chunked.runner.forward = spy
    try:
        _, events = collect(chunked.submit(ask(LONG + " again"), GREEDY))
    finally:
        chunked.runner.forward = real
        running.cancel()
        collect(running)
    assert events[-1].reason in ("length", "stop")
    prefill = [n for decode, n in calls if not decode]
    assert len(prefill) > 20 and max(prefill) <= 7  # the long prompt went in many small chunks
    between, fed = [], 0
    for decode, n in calls:
        if decode:
            between.append(fed)
            fed = 0
        else:
            fed += n
    assert max(between) <= 7


def test_requests_sent_together_to_an_idle_engine_share_one_prefill(tiny_model, tmp_path, monkeypatch):
    """Prompts submitted at the same moment are prefilled in one forward, not the first alone and
    then the rest (which made the last user's first token wait for two prefills)."""
    import threading

    from chat.engine.core import scheduler

    monkeypatch.setattr(scheduler, "GATHER_S", 30.0)  # a slow CI box must not make this flaky
    eng = make_engine(tiny_model, tmp_path)
    count = 4
    entered = threading.Barrier(count)
    fit, forward = eng.fit, eng.runner.forward
    rows = []

    def slow_fit(gen):  # every submit is fitting its prompt when the first one lands
        entered.wait(30)
        return fit(gen)

    def spy(input_ids, kv, positions, spans=None):
        rows.append(input_ids.shape[0])
        return forward(input_ids, kv, positions, spans)

    gens = [None] * count

    def send(i):
        gens[i] = eng.submit(ask(QUESTIONS[i]), GREEDY)

    eng.fit, eng.runner.forward = slow_fit, spy
    try:
        in_threads(send, count)
        answers = [collect(g)[0] for g in gens]
    finally:
        eng.shutdown()
    assert rows[0] == count and all(answers)
    assert eng.queue.arriving.value == 0


def test_chunks_shrink_when_they_cost_more_than_a_couple_of_decode_steps(tiny_model, tmp_path):
    """The prefill budget is also one of time: chunks whose forward costs several decode steps get
    smaller (to MIN_CHUNK at least), so running rows never wait long between two tokens."""
    import time

    from chat.engine.model.prefill import MIN_CHUNK

    eng = make_engine(tiny_model, tmp_path, prefill_chunk=64)
    forward, prefills = eng.runner.forward, []

    def costly(input_ids, kv, positions, spans=None):  # decode steps 20 ms, prompt tokens 4 ms each
        decode = kv is eng.batch.kv
        if not decode:
            prefills.append(input_ids.shape[1])
        time.sleep(0.02 if decode else 0.004 * input_ids.numel())
        return forward(input_ids, kv, positions, spans)

    try:
        running = busy(eng)
        eng.runner.forward = costly
        for _ in range(20):  # let the measured step time settle
            next(e for e in running if isinstance(e, Delta))
        # the running prompt's cost per token, measured on this box's own forward (a loaded box can make it
        # large enough to cut even the first chunk), forgotten: the next chunk's size is the budget's
        eng.queue.token_s = 0.0
        _, events = collect(eng.submit(ask(LONG), GREEDY))
        first_job = list(prefills)
        # the next long prompt's first chunk is sized from what the last ones cost, not the budget
        _, again = collect(eng.submit(ask("And now: " + LONG), GREEDY))
        running.cancel()
        collect(running)
    finally:
        eng.runner.forward = forward
        eng.shutdown()
    assert events[-1].reason in ("length", "stop") and again[-1].reason in ("length", "stop")
    assert first_job[0] == 64 and len(first_job) > 4
    # 64 tokens cost ~13 steps: every later chunk is cut to about (2 steps - 1 step) / 4 ms = 5 tokens,
    # raised to MIN_CHUNK (more where this box's own compute makes a step slower than 20 ms)
    assert max(first_job[1:-1]) <= 2 * MIN_CHUNK
    assert prefills[len(first_job)] <= 2 * MIN_CHUNK


def test_plan_splits_rows_whose_spans_differ_a_lot():
    from chat.engine.model.attention import plan

    assert plan([10, 20, 0, 5], 300) is None  # similar rows: one call over everything
    assert plan([2100, 2100, 2100, 2100, 0], 2174) == [(0, 4, 2100), (4, 5, 0)]
    assert plan([2100, 0, 2100, 2100], 2174) == [(0, 1, 2100), (1, 2, 0), (2, 4, 2100)]


def test_rows_of_very_different_lengths_attend_over_their_own_columns(chunked):
    """A long prompt among short ones: decode steps split the batch into runs of rows, each over its
    own columns only, and every answer is still the one it gets alone."""
    prompts = QUESTIONS[:3] + [LONG]
    alone = [collect(chunked.submit(ask(q), GREEDY))[0] for q in prompts]
    real, split = chunked.runner.forward, []

    def spy(input_ids, kv, positions, spans=None):
        if spans:
            split.append(spans)
        return real(input_ids, kv, positions, spans)

    chunked.runner.forward = spy
    try:
        gens = [chunked.submit(ask(q), GREEDY) for q in prompts]
        together = [collect(g)[0] for g in gens]
    finally:
        chunked.runner.forward = real
    assert split and all(len(spans) > 1 for spans in split)
    assert together == alone
