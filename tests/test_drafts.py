"""Drafted tokens (chat/engine/core/drafts.py): prompt-lookup guesses, the draft lengths that pay, a C++ step of
several columns (of one row or several, each its own) that is bit for bit the single steps, and answers exactly the
same with drafts as without (greedy, seeded and cut short, alone and beside others).
Needs a C++ compiler, like test_native.py."""
from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import ask, collect, make_engine
from test_native import SHARED, decoder, library  # noqa: F401 (fixtures)
from test_quant import int4_cpu, on_thread

from chat.engine import Delta, GenParams
from chat.engine.core import drafts
from chat.engine.core.slot import Slot
from chat.engine.model import native


def test_ngrams_propose_what_followed_the_longest_latest_match():
    grams = drafts.NGrams([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8])
    assert grams.propose(3) == []  # ... 7, 8: never seen before
    for token in (2, 3, 4):
        grams.push(token)
    # "2 3 4" came twice: the latest time it went on with 7, 8, then 2, 3, 4 (the tokens just pushed)
    assert grams.propose(4) == [7, 8, 2, 3]
    assert grams.propose(1) == [7]
    grams.push(5)  # "3 4 5" only at the start: the longest match wins over the later "4 ..."
    assert grams.propose(2) == [9, 2]
    grams = drafts.NGrams([6, 6])
    assert grams.propose(2) == []  # a 2-gram with nothing after it yet
    grams.push(6)
    assert grams.propose(2) == [6]


def test_the_draft_length_follows_the_acceptance_rate_and_the_cost_of_a_wider_step():
    costs = drafts.Costs()
    costs.measured(1, 0.005)
    costs.measured(5, 0.0088)
    assert drafts.length(0.05, costs, 8) == 0  # guesses that miss cost more than they make
    assert drafts.length(0.95, costs, 0) == 0  # nothing to draft
    assert 3 <= drafts.length(0.95, costs, 8) <= 8
    assert drafts.length(0.95, costs, 2) == 2
    expensive = drafts.Costs()
    expensive.measured(1, 0.005)
    expensive.measured(2, 0.010)  # a second column costs a whole step: only sure guesses would pay
    assert drafts.length(0.9, expensive, 8) == 0
    row = drafts.Row([1, 2])
    for _ in range(30):
        row.checked(4, 0)
    assert row.rate < 0.05  # keeps failing: drafts nothing ...
    for _ in range(300):
        row.idle()
    assert row.rate > 0.45  # ... and tries again once it has drifted back


def test_rows_draft_together_where_the_measured_wide_step_pays_and_not_where_it_does_not():
    costs = drafts.Costs()
    for width, ms in ((1, 20), (2, 22), (4, 26), (8, 40), (12, 56), (16, 70)):  # a step of that many columns
        costs.measured(width, ms / 1000)
    # two rows: each draft is a cheap column; the likeliest go in first, whichever row's; a row without guesses none
    counts = drafts.plan([0.8, 0.5, 0.9], [4, 4, 0], costs, drafts.MAX_WIDTH)
    assert counts[2] == 0 and counts[0] >= counts[1] and counts[0] >= 2
    assert drafts.plan([0.8, 0.8], [6, 1], costs, drafts.MAX_WIDTH)[1] <= 1  # each its own number
    # eight rows: a step of 8 already makes 8 tokens; a wider one costs more than the guesses make
    assert drafts.plan([0.6] * 8, [4] * 8, costs, drafts.MAX_WIDTH) == [0] * 8
    # ... unless they are near sure (an edit quoting its attachment)
    assert sum(drafts.plan([0.97] * 8, [8] * 8, costs, drafts.MAX_WIDTH)) > 0
    assert sum(drafts.plan([0.97] * 8, [8] * 8, costs, 8)) == 0  # no wider step than checked bit for bit
    cheap = drafts.Costs()  # where a wide step is measured as dear as a step each, no drafts at two rows either
    cheap.measured(2, 0.02)
    cheap.measured(3, 0.03)
    assert drafts.plan([0.9, 0.9], [4, 4], cheap, drafts.MAX_WIDTH) == [0, 0]


def test_one_slow_wide_step_does_not_turn_drafts_off_for_good():
    costs = drafts.Costs()
    costs.measured(1, 0.02)
    costs.measured(5, 0.02 * 1.6)
    assert drafts.length(0.9, costs, 4) == 4
    costs = drafts.Costs()
    costs.measured(1, 0.02)
    costs.measured(5, 0.02 * 12)  # the first wide step measured in a busy moment
    assert drafts.length(0.9, costs, 4) == 0
    steps = 0
    while drafts.length(0.9, costs, 4) == 0:  # only one-column steps run meanwhile
        costs.measured(1, 0.02)
        steps += 1
        assert steps < 400, "drafts stayed off"
    assert costs.of(5) < 0.02 * 12 / 2  # back to trying: the next wide step measures it again


class FakeRunner:
    """Fixed logits for a lone row's columns: the row's next token, then the token after the draft."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.kept: list = []

    def verifies(self, columns: int) -> bool:
        return True

    def verifies_rows(self) -> bool:
        return True

    def verify_rows(self, kv, tokens: list, positions: list) -> torch.Tensor:
        assert len(tokens) == 1
        return self.logits[:len(tokens[0])].clone()

    def settle(self, kv, kept: list, opened: int) -> None:
        self.kept.append(kept)

    def sampler(self):
        return None


def fake_slot(params: GenParams, seed: int) -> SimpleNamespace:
    return SimpleNamespace(matcher=None, params=params, generator=torch.Generator().manual_seed(seed), drafts=None,
                           prompt_ids=[1, 2, 3, 1, 2], out_ids=[], max_new=50, context=100, pos=5, last=2)


@pytest.mark.parametrize("params", [GenParams(temperature=1.0, top_p=1.0), GenParams(temperature=0.8, top_k=3)])
def test_a_sampled_answer_with_drafts_keeps_its_exact_distribution(monkeypatch, params):
    """Speculative sampling of a sure draft d: the first token is distributed as the model says (d included),
    and the token after an accepted d as the model says after d; the counts of the engine's prior at this
    temperature follow what the drafts made."""
    draft = 1
    logits = torch.tensor([[1.0, 0.4, -0.3, 0.9, -2.0], [0.2, -1.0, 1.1, 0.0, 0.5]])
    monkeypatch.setattr(drafts.NGrams, "propose", lambda self, most: [draft])
    monkeypatch.setattr(drafts, "plan", lambda rates, most, costs, widest: most)
    drafter, runner = drafts.Drafter(), FakeRunner(logits)
    trials, firsts, seconds = 4000, [], []
    for seed in range(trials):
        slot = fake_slot(params, seed)
        done = drafter.step([slot], [slot], None, runner)
        assert done is not None
        first, [(row, made)] = done
        assert row is slot and torch.equal(first, logits[:1])
        firsts.append(made[0])
        assert len(made) == (2 if made[0] == draft else 1)
        assert runner.kept[-1] == [len(made)] and slot.pos == 5 + len(made)
        if len(made) == 2:
            seconds.append(made[1])

    def exact(row: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(row.double() / params.temperature, -1)
        if params.top_k:
            p[p.argsort(descending=True)[params.top_k:]] = 0
        return p / p.sum()

    for drawn, want in ((firsts, exact(logits[0])), (seconds, exact(logits[1]))):
        n = len(drawn)
        counts = torch.bincount(torch.tensor(drawn), minlength=5).double() / n
        assert torch.all(counts[want == 0] == 0)
        for p, f in zip(want.tolist(), counts.tolist()):
            assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 2 / n) / n)
    assert drafter.accepted == len(seconds) and drafter.drafted == trials
    assert drafter.prior(params.temperature) == pytest.approx(len(seconds) / trials, abs=0.1)
    assert drafter.prior(0.0) == 0.5  # greedy rows keep theirs


def test_a_new_row_starts_from_what_rows_at_its_temperature_made_of_their_drafts(monkeypatch):
    drafter = drafts.Drafter()
    drafter.seen[drafts.band(1.5)] = [0.2, 20.0]
    monkeypatch.setattr(drafts.NGrams, "propose", lambda self, most: [5, 6, 7])
    assert drafts.band(1.4) == drafts.band(1.5) != drafts.band(0.7)
    hot, cold = fake_slot(GenParams(temperature=1.4), 0), fake_slot(GenParams(temperature=0.0), 0)
    for slot in (hot, cold):
        drafter.guess(slot)
    assert hot.drafts.rate == pytest.approx(0.01, abs=1e-3) and cold.drafts.rate == pytest.approx(0.5, abs=1e-3)
    assert drafter.guess(hot) == []  # guesses that rarely hold at this heat: none checked
    steps = 0  # steps without drafts: the temperature's rate, and the row's, drift back towards one in two ...
    while not drafter.guess(hot):
        steps += 1
        assert steps < 400, "a row at this heat never drafts again"
    assert drafter.prior(1.5) > 0.3  # ... until drafting pays again, and is measured again


@int4_cpu
def test_a_step_of_several_columns_is_bit_for_bit_the_single_steps(decoder):  # noqa: F811
    on_thread(lambda: native.use(decoder))
    assert decoder.native is not None
    assert on_thread(lambda: native.columns_agree(decoder, drafts.MAX_DRAFT + 1))


@int4_cpu
def test_a_step_of_several_rows_each_its_own_columns_is_bit_for_bit_each_row_alone(decoder):  # noqa: F811
    """Drafts beyond one row: rows of different lengths, each with its own number of columns (one: no drafts), in
    one C++ step give every column as single steps of that row alone, and their KV, settled, is theirs alone."""
    on_thread(lambda: native.use(decoder))
    assert decoder.native is not None
    assert on_thread(lambda: native.rows_agree(decoder, (3, 1, 5)))
    assert on_thread(lambda: native.rows_agree(decoder, (1, 9)))
    assert on_thread(lambda: native.rows_agree(decoder, (2, 2, 1, 4)))


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory, library):  # noqa: F811
    """Two engines on the tiny model's block products and the C++ step: drafts on, and off."""
    made = {}
    for mode in ("ngram", "off"):
        made[mode] = make_engine(tiny_model, tmp_path_factory.mktemp(f"drafts-{mode}"), dtype="bfloat16", native=True,
                                 cache_dir=str(SHARED), draft=mode)
    deadline = time.monotonic() + 120
    while any(e.stats()["finishing"] for e in made.values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield made
    for e in made.values():
        e.shutdown()


REPEAT = "Repeat after me, twice: the cat sat on the mat and the dog sat on the log and the bird sat on the bench."


@int4_cpu
def test_answers_are_the_same_with_drafts_as_without(engines, monkeypatch):
    on, off = engines["ngram"], engines["off"]
    assert on.runner.verifies(drafts.MAX_DRAFT + 1)
    # The tiny random model never repeats itself, so prompt lookup would guess nothing: the guesses here are
    # the answer's own next tokens (as drafts-off made them), one of them often wrong, and every draft length,
    # not only those that pay on this box: drafts all right, cut at some token, wrong from the first.
    made: list[int] = []
    real_take = Slot.take
    monkeypatch.setattr(Slot, "take", lambda self, token, eos: (made.append(token), real_take(self, token, eos))[1])
    rng = random.Random(5)

    def oracle(grams, most):
        done = len(grams.ids) - prompt_length[0]
        guess = list(reference[done:done + most])
        if guess and rng.random() < 0.5:
            guess[rng.randrange(len(guess))] = rng.randrange(1000)
        return guess

    prompt_length = [0]
    monkeypatch.setattr(drafts.NGrams, "propose", oracle)
    monkeypatch.setattr(drafts, "plan", lambda rates, most, costs, widest: [rng.randint(0, m) for m in most])
    cases = [GenParams(temperature=0, max_new_tokens=120), GenParams(temperature=0.9, seed=3, max_new_tokens=120),
             GenParams(temperature=1.0, top_k=20, min_p=0.05, seed=8, max_new_tokens=120),
             GenParams(temperature=0, max_new_tokens=37)]
    for params in cases:
        made.clear()
        theirs, their_events = collect(off.submit(ask(REPEAT), params))
        reference = list(made)
        prompt_length[0] = their_events[-1].usage["prompt_tokens"]
        before = on.stats()
        mine, events = collect(on.submit(ask(REPEAT), params))
        assert mine == theirs and mine, params
        assert events[-1].usage == their_events[-1].usage and events[-1].reason == their_events[-1].reason
        after = on.stats()
        assert after["draft_steps"] > before["draft_steps"], "nothing drafted"
        assert after["draft_accepted_tokens"] > before["draft_accepted_tokens"]
        assert after["drafted_tokens"] - before["drafted_tokens"] > after["draft_accepted_tokens"] - before[
            "draft_accepted_tokens"], "no guess was wrong"
    assert off.stats()["draft_steps"] == 0
    # a stop sequence inside an accepted run of drafts ends the answer there, as without drafts
    stop = mine[len(mine) // 2:len(mine) // 2 + 3]
    params = GenParams(temperature=0, max_new_tokens=37, stop=(stop,))
    made.clear()
    theirs, their_events = collect(off.submit(ask(REPEAT), params))
    reference = list(made)
    mine, events = collect(on.submit(ask(REPEAT), params))
    assert mine == theirs and events[-1].reason == their_events[-1].reason == "stop"
    assert events[-1].usage == their_events[-1].usage


PROMPTS = [REPEAT, "Count from one to forty, in words, one a line.", "Spell the alphabet backwards, twice.",
           "Name the days of the week and the months of the year."]


@int4_cpu
def test_rows_drafting_together_answer_as_each_would_alone(engines, monkeypatch):
    """Drafts beyond one row: answers decoding together each draft their own number of tokens (none included) in
    one step, and every answer (greedy, seeded, cut by max_tokens or a stop string, a grammar's beside them) is
    the one drafts off gives; then, with every row's guesses right, one step makes several tokens of several rows."""
    on, off = engines["ngram"], engines["off"]
    assert on.runner.verifies_rows()
    made: dict[tuple, list] = {}
    real_take = Slot.take

    def take(self, token, eos):
        made.setdefault(tuple(self.prompt_ids), []).append(token)
        return real_take(self, token, eos)
    monkeypatch.setattr(Slot, "take", take)
    rng = random.Random(7)
    wrong = [0.5]

    def oracle(grams, most):  # the answer's own next tokens, as drafts off made them, one of them often wrong
        key = next(k for k in reference if tuple(grams.ids[:len(k)]) == k)
        done = len(grams.ids) - len(key)
        guess = list(reference[key][done:done + most])
        if guess and rng.random() < wrong[0]:
            guess[rng.randrange(len(guess))] = rng.randrange(1000)
        return guess

    monkeypatch.setattr(drafts.NGrams, "propose", oracle)
    monkeypatch.setattr(drafts, "plan", lambda rates, most, costs, widest: [rng.randint(0, m) for m in most])
    steps: list[list[int]] = []
    real_verify = type(on.runner).verify_rows

    def verify_rows(self, kv, tokens, positions):
        steps.append([len(t) - 1 for t in tokens])
        return real_verify(self, kv, tokens, positions)
    monkeypatch.setattr(type(on.runner), "verify_rows", verify_rows)
    grammar = 'start: "The answer is " /[a-z]+/ "."'
    cases = [GenParams(temperature=0, max_new_tokens=110), GenParams(temperature=0.9, seed=3, max_new_tokens=100),
             GenParams(temperature=0, max_new_tokens=41), GenParams(temperature=0, max_new_tokens=60, grammar=grammar)]

    def run(engine):
        gens = [engine.submit(ask(text), params) for text, params in zip(PROMPTS, cases)]
        return [collect(gen) for gen in gens]
    reference: dict[tuple, list] = {}
    theirs = run(off)
    reference.update(made)
    made.clear()
    mine = run(on)
    for (text, events), (their_text, their_events) in zip(mine, theirs):
        assert text == their_text and text
        assert events[-1].usage == their_events[-1].usage and events[-1].reason == their_events[-1].reason
    together = [s for s in steps if len(s) > 1]
    assert together, "no step had several rows"
    assert any(sum(1 for d in s if d) > 1 for s in together), "never several rows drafting in one step"
    assert any(0 in s and any(s) for s in together), "never a row without drafts beside one with"
    # a stop string inside a run of accepted drafts, rows beside it drafting too
    stop = theirs[0][0][len(theirs[0][0]) // 2:][:4]
    cases[0] = GenParams(temperature=0, max_new_tokens=110, stop=(stop,))
    made.clear()
    theirs = run(off)
    reference.clear()
    reference.update(made)
    wrong[0] = 0.0  # every guess right: several tokens a step
    before = on.stats()
    mine = run(on)
    assert [m[0] for m in mine] == [t[0] for t in theirs] and mine[0][1][-1].reason == "stop"
    after = on.stats()
    assert after["draft_accepted_tokens"] - before["draft_accepted_tokens"] > after["draft_steps"] - before[
        "draft_steps"]


@int4_cpu
def test_a_conversation_drafted_alone_keeps_its_kv_for_the_next_turn(engines, monkeypatch):
    """Alone with drafts, a row's KV still holds exactly its tokens: the next turn reuses it and answers as
    without drafts."""
    monkeypatch.setattr(drafts.NGrams, "propose", lambda grams, most: grams.ids[-most:])  # guesses, mostly wrong
    monkeypatch.setattr(drafts, "plan", lambda rates, most, costs, widest: most)
    turns = []
    for engine in (engines["ngram"], engines["off"]):
        first = collect(engine.submit(ask(REPEAT), GenParams(temperature=0, max_new_tokens=90), key="conv"))[0]
        messages = ask(REPEAT) + [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
        second, events = collect(engine.submit(messages, GenParams(temperature=0, max_new_tokens=60), key="conv"))
        turns.append((first, second, events[-1].reused_tokens))
    assert turns[0] == turns[1] and turns[0][2] > 0
    assert engines["ngram"].stats()["draft_steps"] > 0


@pytest.mark.real_model
def test_the_bundled_model_quoting_its_prompt_makes_several_tokens_a_step(tmp_path, library):  # noqa: F811
    """The default chooser on real text: an answer that repeats its prompt drafts by itself, most guesses right."""
    engine = make_engine("", tmp_path, dtype="auto", native=True, cache_dir=str(SHARED), draft="ngram")
    try:
        deadline = time.monotonic() + 180
        while engine.stats()["finishing"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        text = ("The committee met on a rainy Tuesday to review the budget for the new library wing. Three "
                "suppliers offered timber, and the cheapest one could deliver only in the spring.")
        answer = collect(engine.submit([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                                       GenParams(temperature=0, max_new_tokens=60)))[0]
        stats = engine.stats()
        assert "rainy Tuesday" in answer
        assert stats["draft_steps"] > 0 and stats["draft_accepted_tokens"] > 2 * stats["draft_steps"], stats
    finally:
        engine.shutdown()


def test_no_drafts_without_the_c_step(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path, draft="ngram")  # torch's step: nothing verifies several columns
    try:
        assert not engine.runner.verifies(2)
        collect(engine.submit(ask(REPEAT), GenParams(temperature=0, max_new_tokens=30)))
        assert engine.stats()["draft_steps"] == 0
    finally:
        engine.shutdown()


def test_a_kv_column_written_for_a_wrong_draft_is_never_read():
    """The columns of drafts the answer did not make stay outside the row: the step after writes over them."""
    kv = native_free_buffer()
    kv.open(4)
    kv.advance(2)
    kv.mask[:, kv.length:kv.length + 2] = 0  # as the engine leaves them
    kv.open(1)  # the next step
    assert kv.row_starts(1) == [0] and kv.length == 2
    assert torch.equal(kv.attention_mask(1), torch.ones(1, 3, dtype=kv.mask.dtype))


def test_rows_that_kept_fewer_drafted_columns_end_with_the_others_again():
    """After a step of several rows' drafts each row's tokens end at the buffer's last column again: a row that kept
    fewer columns moved right (what ``native.shift`` does, here in torch), the columns before it padding, the
    columns nobody kept closed."""
    from chat.engine.kv.buffer import KVBuffer
    kv = KVBuffer(1, 1, 16, torch.bfloat16, torch.device("cpu"), rows=2, capacity=16, active=0)
    for n in (3, 5):  # two rows: 3 and 5 tokens, column values their token numbers
        kv.add_row([torch.arange(n, dtype=torch.bfloat16)[None, None, :, None].expand(1, 1, n, 16)],
                   [torch.arange(n, dtype=torch.bfloat16)[None, None, :, None].expand(1, 1, n, 16)])
    kv.open(4)
    for t in kv.keys + kv.values:  # the step's columns: row 0's tokens 3..6, row 1's 5..8
        t[0, :, kv.length:kv.length + 4] = torch.arange(3, 7, dtype=torch.bfloat16)[:, None]
        t[1, :, kv.length:kv.length + 4] = torch.arange(5, 9, dtype=torch.bfloat16)[:, None]

    def move(buffer, moves):
        for r, first, last, by in moves:
            for t in buffer.keys + buffer.values:
                t[r, :, first + by:last + by] = t[r, :, first:last].clone()
    kv.settle([1, 3], 4, move)  # row 0 kept its last token's column only, row 1 two drafts more
    assert kv.length == 5 + 3 and kv.row_starts(0) == [kv.length - kv.start - 4, 0]
    keys, _ = kv.row(0)
    assert keys[0][0, 0, :, 0].tolist() == [0, 1, 2, 3]
    keys, _ = kv.row(1)
    assert keys[0][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    kv.open(1)  # the next step sees each row's own columns only
    assert kv.row_starts(1) == [kv.length + 1 - kv.start - 5, 0]
    assert int(kv.mask[:, kv.length + 1:].sum()) == 0


def native_free_buffer():
    from chat.engine.kv.buffer import KVBuffer
    return KVBuffer(2, 1, 16, torch.bfloat16, torch.device("cpu"), rows=1, capacity=8, active=1)


@int4_cpu
def test_a_scored_prompt_has_the_log_probabilities_decode_steps_give(engines):
    """A prompt scored position by position (/v1/completions with echo and logprobs) goes through the C++ step's
    columns, each bit for bit a decode step: the log probabilities of the text fed token by token."""
    engine = engines["off"]
    events = list(engine.submit([{"role": "user", "content": REPEAT}],
                                GenParams(max_new_tokens=0, prompt_logprobs=0, raw_prompt=True)))
    got = [e["logprob"] for d in events if isinstance(d, Delta) for e in d.prompt_logprobs][1:]
    ids = engine.loaded.tokenizer.encode(REPEAT)
    model = engine.decoder

    def steps():
        kv, out = model.cache(1, len(ids) + 8), []
        for i in range(len(ids) - 1):
            kv.open(1)
            logits = model(torch.tensor([[ids[i]]]), kv, torch.tensor([[i]]))
            kv.advance(1)
            out.append(float(torch.log_softmax(logits[0], dim=-1)[ids[i + 1]]))
        return out
    assert model.native is not None and len(got) == len(ids) - 1 > 20
    assert got == pytest.approx(on_thread(steps), abs=1e-6)
