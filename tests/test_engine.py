"""The engine in-process (no gevent): batching, seeds, cancel, queue, prefix reuse."""
from __future__ import annotations

import pytest
from helpers import QUESTIONS, ask, collect, make_engine

from chat.engine import Delta, Done, GenParams, Queued, Started
from chat.errors import Overloaded


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("engine"))
    yield eng
    eng.shutdown()


def test_batched_greedy_equals_unbatched(engine):
    alone = [collect(engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=48)))[0] for q in QUESTIONS]
    gens = [engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=48)) for q in QUESTIONS]
    together = [collect(g)[0] for g in gens]
    assert together == alone


@pytest.fixture(scope="module")
def bf16_engine(tiny_model, tmp_path_factory):
    """The engine in bfloat16: its products (oneDNN's bf16 matmul) give a row the same bits whatever
    else is in the batch, which float32's (MKL's) do not (rows of one batch differ by ~1e-6 from the
    same row alone, enough for a sampled answer to drift apart after a few dozen tokens)."""
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("engine-bf16"), dtype="bfloat16")
    yield eng
    eng.shutdown()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(bf16_engine):
    engine = bf16_engine
    params = GenParams(temperature=0.9, top_p=0.95, seed=99, max_new_tokens=40)
    alone = collect(engine.submit(ask("sample me"), params))[0]
    others = [engine.submit(ask(q), GenParams(temperature=1.0, max_new_tokens=80)) for q in QUESTIONS]
    mine = engine.submit(ask("sample me"), params)
    assert collect(mine)[0] == alone
    for g in others:
        collect(g)


def test_request_joining_mid_batch(engine):
    expected = collect(engine.submit(ask("late joiner"), GenParams(temperature=0, max_new_tokens=30)))[0]
    long = engine.submit(ask("long one"), GenParams(temperature=0, max_new_tokens=300))
    for event in long:
        if isinstance(event, Delta):
            break
    late = engine.submit(ask("late joiner"), GenParams(temperature=0, max_new_tokens=30))
    assert collect(late)[0] == expected
    long.cancel()
    assert [e for e in long if isinstance(e, Done)][0].reason == "cancelled"


def test_background_work_waits_until_no_answer_decodes_or_waits(engine):
    """A title (``background``) starts only once every answer has ended, one that arrived after it included;
    alone it starts at once, and it gives the answer it would give in the foreground."""
    title_params = GenParams(temperature=0, max_new_tokens=8, background=True)
    expected = collect(engine.submit(ask("title this"), GenParams(temperature=0, max_new_tokens=8)))[0]
    alone = engine.submit(ask("title this"), title_params)
    assert collect(alone)[0] == expected  # nothing else to wait for
    order = []  # the engine thread's lifecycle events, in the order it emitted them

    def watched(name, gen):
        gen.observers.append(lambda event: order.append((name, type(event).__name__)))
        return gen

    answer = watched("answer", engine.submit(ask("a long answer"), GenParams(temperature=0, max_new_tokens=80)))
    next(e for e in answer if isinstance(e, Delta))
    title = watched("title", engine.submit(ask("title this"), title_params))
    later = watched("later", engine.submit(ask("another answer"), GenParams(temperature=0, max_new_tokens=20)))
    collect(later)
    collect(answer)
    assert collect(title)[0] == expected
    started = order.index(("title", "Started"))
    assert order.index(("answer", "Done")) < started and order.index(("later", "Done")) < started, order
    assert order.index(("later", "Started")) < started


def test_cancel_mid_batch_leaves_the_others_intact(engine):
    expected = [collect(engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=60)))[0] for q in QUESTIONS]
    gens = [engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=60)) for q in QUESTIONS]
    victim = engine.submit(ask("victim"), GenParams(temperature=0, max_new_tokens=4000))
    for event in victim:
        if isinstance(event, Delta):
            victim.cancel()
        if isinstance(event, Done):
            assert event.reason == "cancelled"
            assert event.usage["completion_tokens"] < 4000
    assert [collect(g)[0] for g in gens] == expected


def test_prefix_reuse_gives_identical_greedy_answers(engine):
    history = ask("first question about prefix reuse")
    first, _ = collect(engine.submit(history, GenParams(temperature=0, max_new_tokens=24), key="conv-a"))
    turn2 = history + [{"role": "assistant", "content": first}, {"role": "user", "content": "second question"}]
    reused_text, reused_events = collect(engine.submit(turn2, GenParams(temperature=0, max_new_tokens=24),
                                                       key="conv-a"))
    engine.prefix.pop("conv-a")  # else the fresh prompt would start from conv-a's KV too (a common prefix)
    fresh_text, fresh_events = collect(engine.submit(turn2, GenParams(temperature=0, max_new_tokens=24)))
    # (a prompt of no conversation may still reuse its system prompt's shared preamble: fewer tokens)
    assert reused_events[-1].reused_tokens > fresh_events[-1].reused_tokens
    assert reused_text == fresh_text


def test_a_new_conversation_reuses_its_system_prompts_shared_preamble(tiny_model, tmp_path):
    from helpers import until

    from chat.engine.core import prompt
    eng = make_engine(tiny_model, tmp_path, system_prompt="You are the default.")
    try:
        tokenizer = eng.loaded.tokenizer
        default = prompt.preamble(tokenizer, [{"role": "system", "content": "You are the default."}])
        assert until(lambda: eng.prefix.has_preamble(default), timeout=60)  # warmed while idle after start-up
        params = GenParams(temperature=0, max_new_tokens=16)
        system = "You are a pirate who answers in one line."
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS[:3]]
        cold, cold_events = collect(eng.submit(chats[0], params, key="c0"))
        assert cold_events[-1].reused_tokens == 0  # this system prompt was not seen before
        mine = prompt.preamble(tokenizer, chats[0])
        assert until(lambda: eng.prefix.has_preamble(mine), timeout=60)  # prefilled alone while idle, then shared
        other, other_events = collect(eng.submit(chats[1], params))  # another question, no conversation
        assert other_events[-1].reused_tokens >= len(mine)  # the preamble (and any words in common with c0's)
        # the same question in another conversation: all but its last token from c0's keys and values
        warm, warm_events = collect(eng.submit(chats[0], params, key="c1"))
        assert warm_events[-1].reused_tokens == warm_events[-1].usage["prompt_tokens"] - 1 and warm == cold
        assert eng.stats()["prefix_shared_hits"] >= 2
        # a prompt that does not start with exactly the preamble's ids takes no more of it than the ids they
        # have in common (or its own system prompt's preamble, if the idle engine prefilled that first)
        changed = [{"role": "system", "content": system + "!"}, {"role": "user", "content": QUESTIONS[0]}]
        _, events = collect(eng.submit(changed, params))
        own = prompt.preamble(tokenizer, changed)
        common = next(i for i, (a, b) in enumerate(zip(own, mine)) if a != b)  # where the system prompts part
        assert 0 < common < len(mine) and events[-1].reused_tokens in (*range(common + 1), len(own))
    finally:
        eng.shutdown()


def test_prefix_cache_evicts_under_a_tiny_budget(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path, kv_cache_mb=1)
    try:
        for i in range(30):
            collect(eng.submit(ask(f"conversation {i} " * 40), GenParams(temperature=0, max_new_tokens=20),
                               key=f"k{i}"))
        assert eng.prefix.used <= 1024 * 1024
        assert 0 < len(eng.prefix.entries) < 30
        assert "k29" in eng.prefix.entries and "k0" not in eng.prefix.entries
    finally:
        eng.shutdown()


def test_queue_positions_and_overload(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path, max_batch=1, max_queue=2)
    try:
        running = eng.submit(ask("a"), GenParams(temperature=0, max_new_tokens=4000))
        next(e for e in running if isinstance(e, Delta))
        second = eng.submit(ask("b"), GenParams(temperature=0, max_new_tokens=5))
        third = eng.submit(ask("c"), GenParams(temperature=0, max_new_tokens=5))
        with pytest.raises(Overloaded) as err:
            eng.submit(ask("d"), GenParams(temperature=0, max_new_tokens=5))
        assert err.value.code == "overloaded"
        assert second.next_event(10) == Queued(1)
        assert third.next_event(10) == Queued(2)
        second.cancel()  # leaving the queue moves the one behind up
        assert third.next_event(10) == Queued(1)
        assert list(second)[-1].reason == "cancelled"
        running.cancel()
        events = list(third)
        assert isinstance(events[0], Started) and events[-1].reason == "length"
    finally:
        eng.shutdown()


def test_timeout_and_shutdown_reasons(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path, generation_timeout_s=0.3)
    gen = eng.submit(ask("forever"), GenParams(temperature=0, max_new_tokens=4000))
    assert list(gen)[-1].reason == "timeout"
    eng.shutdown()
    with pytest.raises(Overloaded):
        eng.submit(ask("late"), GenParams())


def test_a_failing_step_ends_the_batch_with_error_and_the_engine_goes_on(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path)
    try:
        real_forward = eng.runner.forward
        broken = {"on": True}

        def flaky(*args, **kwargs):
            if broken["on"] and args[0].shape[1] == 1:
                broken["on"] = False
                raise RuntimeError("simulated kernel failure")
            return real_forward(*args, **kwargs)

        eng.runner.forward = flaky
        failed = list(eng.submit(ask("first"), GenParams(temperature=0, max_new_tokens=20)))
        assert failed[-1].reason == "error"
        ok = list(eng.submit(ask("second"), GenParams(temperature=0, max_new_tokens=20)))
        assert ok[-1].reason == "length" and ok[-1].usage["completion_tokens"] == 20
    finally:
        eng.shutdown()


def test_greedy_output_equals_transformers_generate(engine):
    import torch

    from chat.engine.core import prompt
    messages = ask("compare me with generate")
    text, events = collect(engine.submit(messages, GenParams(temperature=0, max_new_tokens=32)))
    loaded = engine.loaded
    ids = prompt.render(loaded.tokenizer, messages)
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, eos_token_id=sorted(loaded.eos_ids),
                                    pad_token_id=loaded.tokenizer.eos_token_id)
    new = out[0, len(ids):].tolist()
    while new and new[-1] in loaded.eos_ids:
        new.pop()
    assert events[-1].usage["completion_tokens"] == len(new)
    assert text == loaded.tokenizer.decode(new, skip_special_tokens=True)


def test_continue_leaves_the_answer_open_and_reuses_the_prefix(engine):
    from chat.engine.core import prompt
    history = ask("a question to continue")
    first, _ = collect(engine.submit(history, GenParams(temperature=0, max_new_tokens=8), key="conv-c"))
    tokenizer = engine.loaded.tokenizer
    open_turn = tokenizer.decode(prompt.render(tokenizer, history + [
        {"role": "assistant", "content": first, "prefix": True}]))
    assert open_turn.endswith(first) and open_turn == tokenizer.decode(prompt.render(tokenizer, history)) + first
    more, events = collect(engine.submit(history + [{"role": "assistant", "content": first, "prefix": True}],
                                         GenParams(temperature=0, max_new_tokens=8), key="conv-c"))
    assert events[-1].reused_tokens > 0
    assert events[-1].usage["completion_tokens"] <= 8  # done counts only the new tokens
    whole, _ = collect(engine.submit(history, GenParams(temperature=0, max_new_tokens=16)))
    assert first + more == whole  # greedy: continuing equals answering at once


def test_deltas_count_the_answers_tokens_as_done_does(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path)
    try:
        for params in (GenParams(temperature=0, max_new_tokens=40),
                       GenParams(temperature=1.0, seed=3, max_new_tokens=60),
                       GenParams(temperature=0, max_new_tokens=30, stop=("e",))):
            events = list(eng.submit(ask("count with me"), params))
            deltas = [e for e in events if isinstance(e, Delta) and e.text]
            counts = [d.tokens for d in deltas]
            assert counts == sorted(counts) and counts[0] >= 1, counts
            assert len(deltas) <= counts[-1]  # a delta may carry several tokens, never fewer than one
            done = events[-1]
            assert counts[-1] == done.usage["completion_tokens"] or (
                done.reason == "stop" and counts[-1] == done.usage["completion_tokens"] - 1), (counts, done)
            # The engine's own count can trail by the end token alone (it makes no text).
    finally:
        eng.shutdown()
