"""Prefill shared between addresses, in bounded memory: one address's long prompts cannot take more
than its share of the time between decode steps, nor keep another address's prompt waiting behind
all of them (issue 33, item 7). No timing: what is counted is prompt tokens per forward."""
from __future__ import annotations

import threading

import pytest
from helpers import ask, collect, events_of, make_engine

from chat.engine import Delta, Done, GenParams
from chat.engine.core.scheduler import PREFILL_FORWARD_TOKENS

CHUNK = 32


@pytest.fixture
def engine(tiny_model, tmp_path):
    eng = make_engine(tiny_model, tmp_path, context_tokens=2048, prefill_chunk=CHUNK, max_batch=16)
    yield eng
    eng.shutdown()


@pytest.fixture
def forwards(engine, monkeypatch):
    """(rows, columns, prefilling tokens, a decode step?) of every forward the engine runs from now on."""
    seen: list[tuple[int, int, int, bool]] = []
    forward = engine.runner.forward

    def spy(input_ids, kv, position_ids, spans=None):
        held = sum(job.rows * job.tokens.shape[1] for job in engine.queue.jobs)
        seen.append((input_ids.shape[0], input_ids.shape[1], held, kv is engine.batch.kv))
        return forward(input_ids, kv, position_ids, spans)
    monkeypatch.setattr(engine.runner, "forward", spy)
    return seen


def long_prompt(i: int, words: int = 900) -> list:
    return ask(f"{i} " + "lighthouse " * words)


def first_delta(gen) -> None:
    while not isinstance(gen.next_event(120), Delta):
        pass


def test_one_address_gets_one_share_between_decode_steps(engine, forwards):
    bystander = engine.submit(ask("tell me a story"), GenParams(temperature=0, max_new_tokens=100_000), owner="B")
    first_delta(bystander)
    flood = [engine.submit(long_prompt(i, 300), GenParams(temperature=0, max_new_tokens=2), owner="A")
             for i in range(7)]
    for gen in flood:
        assert events_of(gen, 300)[-1].reason in ("length", "stop")
    bystander.cancel()
    events_of(bystander, 60)
    # between two decode steps (one column per row), the prompt tokens prefilled
    between, worst = 0, 0
    for rows, columns, _, decode in forwards:
        if decode:
            worst, between = max(worst, between), 0
        else:
            between += rows * columns
    assert worst <= 2 * CHUNK  # one owner's share (a chunk, each job's rounded up to whole rows), not seven
    assert worst > 0


def test_another_address_is_not_queued_behind_every_long_prompt(engine):
    flood = [engine.submit(long_prompt(i), GenParams(temperature=0, max_new_tokens=1), owner="A") for i in range(7)]
    other = engine.submit(long_prompt(99), GenParams(temperature=0, max_new_tokens=1), owner="C")
    order: list[str] = []  # as the engine thread ended them (a consumer thread may be scheduled late)
    for name, gen in [*((f"A{i}", g) for i, g in enumerate(flood)), ("C", other)]:
        gen.observers.append(lambda event, name=name: order.append(name) if isinstance(event, Done) else None)
    threads = [threading.Thread(target=events_of, args=(g, 300)) for g in [*flood, other]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(order) == 8
    assert order.index("C") < 7, order  # C's answer ended before the last of A's


def test_prompts_under_way_are_finished_one_after_another_shortest_first(engine, monkeypatch):
    """Equals (other addresses, nothing prefilled before) are not cut into turns, which would give each its first
    token only once all were done: the one with the fewest tokens left goes on until it is done (a shorter one
    arriving passes it once), then the next. Beside a decoding answer, so each prompt takes several chunks."""
    from chat.engine.core import scheduler
    order: list[str] = []  # the owner of every prefill chunk, in order
    ran = scheduler.Scheduler._ran

    columns: dict[str, list[int]] = {}  # per owner: its chunks' columns, and its prompt's

    def spy(self, plan, chunk):
        order.append(chunk.job.slots[0].gen.owner)
        columns.setdefault(order[-1], [0, chunk.job.tokens.shape[1]])[0] += chunk.columns
        ran(self, plan, chunk)
    monkeypatch.setattr(scheduler.Scheduler, "_ran", spy)
    bystander = engine.submit(ask("tell me a story"), GenParams(temperature=0, max_new_tokens=100_000), owner="B")
    first_delta(bystander)
    order.clear()
    sizes = {"X": 200, "Y": 300, "Z": 100}  # seeded, sampled: each prompt a job of its own
    gens = {who: engine.submit(long_prompt(i, words), GenParams(temperature=0.7, seed=i, max_new_tokens=1),
                               owner=who) for i, (who, words) in enumerate(sizes.items())}
    for gen in gens.values():
        assert events_of(gen, 300)[-1].reason in ("length", "stop")
    bystander.cancel()
    events_of(bystander, 60)
    runs = [who for i, who in enumerate(order) if i == 0 or order[i - 1] != who]
    assert len(order) > 12 and len(runs) <= 4, runs  # (round robin: a run a chunk)
    assert sorted(sizes, key=lambda who: len(order) - order[::-1].index(who)) == ["Z", "X", "Y"], order
    assert all(chunked == prompt for chunked, prompt in columns.values()), columns  # no chunk past a prompt's end


def test_more_addresses_waiting_than_decoding_get_their_shares_rounded_up(engine, monkeypatch):
    """Three addresses waiting for a first token beside two decoding get two shares of the time between decode
    steps (3 / 2 rounded up), not one."""
    from chat.engine.core import scheduler
    shares: list[tuple[int, int]] = []  # (owners prefilling, share) of every plan with prompts in prefill
    plan = scheduler.Scheduler.plan

    def spy(self, rows, step_s, stopping):
        made = plan(self, rows, step_s, stopping)
        if self.jobs:
            shares.append((len({scheduler.owner(s.gen) for job in self.jobs for s in job.slots}), made.share))
        return made
    monkeypatch.setattr(scheduler.Scheduler, "plan", spy)
    bystanders = [engine.submit(ask(f"tell me story {i}"), GenParams(temperature=0, max_new_tokens=100_000),
                                owner=f"B{i}") for i in range(2)]
    for gen in bystanders:
        first_delta(gen)
    gens = [engine.submit(long_prompt(i, 300), GenParams(temperature=0.7, seed=i, max_new_tokens=1), owner=who)
            for i, who in enumerate("XYZ")]
    for gen in gens:
        assert events_of(gen, 300)[-1].reason in ("length", "stop")
    for gen in bystanders:
        gen.cancel()
        events_of(gen, 60)
    assert (3, 2) in shares and (3, 1) not in shares, shares


def test_prefill_memory_is_bounded(engine, forwards):
    gens = [engine.submit(long_prompt(i), GenParams(temperature=0, max_new_tokens=1), owner="A") for i in range(7)]
    for gen in gens:
        events_of(gen, 300)
    prefills = [(rows, columns, held) for rows, columns, held, decode in forwards if not decode]
    assert max(rows * columns for rows, columns, _ in prefills) <= PREFILL_FORWARD_TOKENS
    assert max(held for _, _, held in prefills) <= engine.queue.budget_tokens
    assert len(prefills) > 1  # 7 prompts of ~900 tokens did not go in one forward


def test_an_answer_prefills_before_background_work_already_under_way(engine, monkeypatch):
    """A title (``background``) prefilling when an answer's prompt arrives yields the next chunks to the answer,
    even of the same owner (equal prefill spent, the title the older job): the answer's prompt ends first."""
    forward, started, go = engine.runner.forward, threading.Event(), threading.Event()

    def held(input_ids, kv, position_ids, spans=None):  # the title's first chunk waits for the answer's submit
        if not started.is_set():
            started.set()
            go.wait(60)
        return forward(input_ids, kv, position_ids, spans)
    monkeypatch.setattr(engine.runner, "forward", held)
    title = engine.submit(long_prompt(1, 300), GenParams(temperature=0, max_new_tokens=1, background=True),
                          owner="A")
    assert started.wait(60)
    answer = engine.submit(long_prompt(2, 300), GenParams(temperature=0, max_new_tokens=1), owner="A")
    order: list[str] = []
    for name, gen in (("title", title), ("answer", answer)):
        gen.observers.append(lambda event, name=name: order.append(name) if isinstance(event, Done) else None)
    go.set()
    for gen in (title, answer):
        assert events_of(gen, 300)[-1].reason in ("length", "stop")
    assert order == ["answer", "title"]


def test_an_answer_arriving_while_only_a_title_decodes_is_prefilled_whole(engine, forwards):
    """Titles decoding stall nobody who waits: an answer's prompt that arrives meanwhile goes in one forward,
    as with nothing decoding, not in chunks between the title's decode steps."""
    title = engine.submit(ask("title this"), GenParams(temperature=0, max_new_tokens=100_000, background=True),
                          owner="A")
    next(e for e in title if isinstance(e, Delta))
    forwards.clear()
    answer = engine.submit(long_prompt(1, 300), GenParams(temperature=0, max_new_tokens=1), owner="A")
    assert events_of(answer, 300)[-1].reason in ("length", "stop")
    title.cancel()
    events_of(title, 60)
    prefills = [(rows, columns) for rows, columns, _, decode in forwards if not decode]
    assert prefills and prefills[0][1] > 300 > 2 * CHUNK, prefills  # the whole prompt, not CHUNK at a time


def test_background_prefill_goes_in_chunks_of_about_two_decode_steps(tiny_model, tmp_path, monkeypatch):
    """With nothing else running, a title's prompt is cut by time (about STALL decode steps a forward, as the
    chunks' measured cost says), not only by CHAT_PREFILL_CHUNK: an answer arriving meanwhile waits for one
    such forward at most. The measured cost is pinned here (tokens worth 25 per STALL steps)."""
    from chat.engine.core import scheduler
    eng = make_engine(tiny_model, tmp_path, context_tokens=2048, prefill_chunk=1024, max_batch=16)
    try:
        ran = scheduler.Scheduler._ran

        def pinned(self, plan, chunk):
            ran(self, plan, chunk)
            self.token_s = scheduler.STALL * plan.step_s / 25
        monkeypatch.setattr(scheduler.Scheduler, "_ran", pinned)
        collect(eng.submit(ask("warm up"), GenParams(temperature=0, max_new_tokens=2)))  # a cost measured
        seen: list[int] = []
        forward = eng.runner.forward

        def spy(input_ids, kv, position_ids, spans=None):
            if kv is not eng.batch.kv:
                seen.append(input_ids.shape[1])
            return forward(input_ids, kv, position_ids, spans)
        monkeypatch.setattr(eng.runner, "forward", spy)
        title = eng.submit(long_prompt(1, 300), GenParams(temperature=0, max_new_tokens=1, background=True))
        assert events_of(title, 300)[-1].reason in ("length", "stop")
        assert len(seen) > 10 and max(seen) == 25, seen  # 300+ tokens, 25 a forward (prefill_chunk allows 1024)
    finally:
        eng.shutdown()
