"""Chunked prefill between decode steps: same answers as one-shot prefill, running rows keep moving."""
from __future__ import annotations

import pytest

from chat.engine import Delta, GenParams
from test_engine import QUESTIONS, ask, collect, make_engine

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
    real = chunked._forward

    def spy(input_ids, kv, positions):
        calls.append((kv is chunked.kv, input_ids.numel()))
        return real(input_ids, kv, positions)

    running = busy(chunked)
    chunked._forward = spy
    try:
        _, events = collect(chunked.submit(ask(LONG + " again"), GREEDY))
    finally:
        chunked._forward = real
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
