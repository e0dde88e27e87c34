"""Drafted tokens (``CHAT_DRAFT=ngram``): a lone answer's next few tokens guessed from its own context and
checked in one step, so one read of the weights can make several tokens.

The guess is prompt lookup: the tokens that followed the last earlier time the answer's latest
``MAX_N`` (down to ``MIN_N``) tokens appeared in its prompt or answer: quoting an attachment, editing
code, repeating a list or a name. No draft model: none smaller than the 135M model exists. The
engine feeds the row's last token and the drafts as one C++ step of several columns
(``Decoder.verify``), whose every column is bit for bit what a step of it alone gives, then samples
column after column with the row's own sampler and generator, as the answer would have been made, and
keeps the drafts up to the first one the answer did not make, and the token made there. So a greedy
answer and a seeded one are the same with drafts as without, and a sampled one keeps its distribution.
That is the standard speculative-sampling rule for a draft that is one token for sure (q(d) = 1): it
accepts d with probability min(1, p(d) / q(d)) = p(d), which is the chance the answer's own draw is d,
and after a rejection it draws from the residual max(0, p - q), normalized: p without d, which is the
answer's own draw given that it was not d. Drawing the answer's token with its own generator and comparing
does both at once and keeps the generator's draws those of single steps.

How many tokens to draft follows what it pays: each row keeps a running acceptance rate (a new row
starts from the rate the engine has seen at its temperature: sampled answers accept fewer guesses, the
hotter the fewer), the engine a running cost of a step of each width, and the draft is the length that
gives the most tokens per second (none when a single token does: a row whose guesses keep failing drafts
nothing, and tries again once its rate has drifted back towards its prior). A wide step's cost, when
dearer than the first guess, drifts back towards that guess while no wide step runs, so one slow
measurement (a busy moment on a shared box) never turns drafts off for good.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from ..model.sampling import sample_rows

MIN_N, MAX_N = 2, 4  # n-gram lengths looked up, longest first
MAX_DRAFT = 8  # tokens a row drafts at most in one step
MAX_WIDTH = 4 * (MAX_DRAFT + 1)  # columns of a drafted step at most, its rows' and their drafts together
DECAY = 0.9  # of a row's acceptance counts per step that drafts
DRIFT = 0.98  # per step without drafts: back towards the prior
SEEN_DECAY = 0.98  # of the engine's acceptance counts by temperature, per drafted step


def band(temperature: float) -> float:
    """The temperatures whose rows share an acceptance prior: greedy, then steps of 0.25 up to 2."""
    return 0.0 if temperature <= 0 else min(max(round(temperature * 4) / 4, 0.25), 2.0)


class NGrams:
    """A row's tokens (prompt, then answer) with, for each n-gram, where it last continued."""

    def __init__(self, ids: list[int]) -> None:
        self.ids: list[int] = []
        self.index: dict[tuple, int] = {}  # n-gram -> the position after its latest occurrence but the last
        for token in ids:
            self.push(token)

    def push(self, token: int) -> None:
        ids = self.ids
        end = len(ids)
        for n in range(MIN_N, MAX_N + 1):  # the n-grams ending at the old last token now have a continuation
            if end >= n:
                self.index[tuple(ids[end - n:end])] = end
        ids.append(token)

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` tokens that followed the longest recent match of the latest tokens ([]: none)."""
        ids = self.ids
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(ids) > n:
                at = self.index.get(tuple(ids[-n:]))
                if at is not None:
                    return ids[at:at + most]
        return []


class Row:
    """One answer's drafting state: its n-grams and its acceptance counts."""

    def __init__(self, ids: list[int], prior: float = 0.5) -> None:
        self.grams = NGrams(ids)
        self.prior = prior  # the rate it starts from (its temperature's, as seen so far) and drifts back to
        self.hits, self.tries = 2.0 * prior, 2.0

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def checked(self, drafted: int, right: int) -> None:
        """``right`` of ``drafted`` tokens were what the answer made (it stopped at the first wrong one)."""
        self.hits = self.hits * DECAY + right
        self.tries = self.tries * DECAY + right + (1 if right < drafted else 0)

    def idle(self, prior: float | None = None) -> None:
        """A step without drafts: the counts drift back towards ``prior`` (its own when None), so a row tries
        again later."""
        if prior is not None:
            self.prior = prior
        self.hits = 2.0 * self.prior + (self.hits - 2.0 * self.prior) * DRIFT
        self.tries = 2.0 + (self.tries - 2.0) * DRIFT


def guessed(width: int, base: int = 1) -> float:
    """A step of ``width`` columns against one of ``base`` columns (rows), before it is measured: each more column
    costs a third of a column's share of the base step (one row: each more column a third of the step)."""
    return 1 + (width - base) / (3 * base)


class Costs:
    """A step's running cost by its width (columns: its rows' and their drafts together), measured; widths not
    seen yet are estimated: between two measured widths on the line through them, past the widest on the line
    through the two widest (no cheaper than ``guessed``). A width dearer than its guess from a narrower width just
    measured drifts back towards that guess with each such step, so drafts turned off by one slow wide step (a busy
    moment on a shared box) are tried again (and measured again)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def measured(self, width: int, seconds: float) -> None:
        known = self.seconds.get(width)
        self.seconds[width] = cost = seconds if known is None else known + (seconds - known) / 8
        for w, dear in self.seconds.items():
            if w > width:
                guess = cost * guessed(w, width)
                if dear > guess:
                    self.seconds[w] = guess + (dear - guess) * DRIFT

    def of(self, width: int) -> float:
        if width in self.seconds:
            return self.seconds[width]
        below = [w for w in self.seconds if w < width]
        above = [w for w in self.seconds if w > width]
        if below and above:
            lo, hi = max(below), min(above)
            return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (width - lo) / (hi - lo)
        if below:  # past the widest: on the line through the two widest, at least a third of a column's share more
            lo = max(below)
            slope = self.seconds[lo] / (3 * lo)
            if len(below) > 1:
                lo2 = max(w for w in below if w != lo)
                slope = max(slope, (self.seconds[lo] - self.seconds[lo2]) / (lo - lo2))
            return self.seconds[lo] + slope * (width - lo)
        if above:  # narrower than any measured: in proportion
            hi = min(above)
            return self.seconds[hi] * guessed(width) / guessed(hi)
        return 0.01 * guessed(width)


def plan(rates: list[float], most: list[int], costs: Costs, widest: int) -> list[int]:
    """How many drafted tokens each row of a step feeds (0 to ``most[r]``): the numbers that make the most tokens
    per second, when row r's drafts are each right with probability ``rates[r]`` (given the ones before it were),
    a step costs ``costs.of(its width)`` and is at most ``widest`` columns. The step's rows make one token each for
    sure and a draft its rate to the power of its place: the likeliest drafts go in first, whichever row's, and
    the step is as wide as pays clearly (all zeros when a step without drafts makes the most: every row's guesses
    too unlikely, or a wider step too dear, as at many rows)."""
    rows = len(rates)
    gains = sorted(((rate ** j, r) for r, (rate, n) in enumerate(zip(rates, most)) for j in range(1, n + 1)),
                   key=lambda g: -g[0])[:max(0, widest - rows)]
    best, best_speed, made = 0, rows / costs.of(rows), float(rows)
    for k, (gain, _) in enumerate(gains, 1):
        made += gain  # tokens a step with these k drafts makes, on average
        speed = made / costs.of(rows + k)
        if speed > best_speed * 1.02:  # a clear gain only: a draft costs when it misses
            best, best_speed = k, speed
    counts = [0] * rows
    for _, r in gains[:best]:
        counts[r] += 1
    return counts


def length(rate: float, costs: Costs, most: int) -> int:
    """``plan`` for a lone row."""
    return plan([rate], [most], costs, most + 1)[0]


class Drafter:
    """The engine's drafting: what to guess for each row and how many, the steps' costs, and the counts
    ``/readyz`` reports (steps with drafts, tokens drafted, tokens the answers made as drafted)."""

    def __init__(self, on: bool = True) -> None:
        self.on = on  # CHAT_DRAFT
        self.costs = Costs()
        self.steps = self.drafted = self.accepted = 0
        self.seen: dict[float, list[float]] = {}  # by temperature (``band``): [hits, tries], decayed

    def prior(self, temperature: float) -> float:
        """The acceptance rate a new row at ``temperature`` starts from: what rows at about that temperature
        made of their drafts lately (one in two before any)."""
        hits, tries = self.seen.get(band(temperature), (1.0, 2.0))
        return hits / tries

    def candidates(self, slot: Any) -> list[int]:
        """What ``slot`` (an engine ``Slot`` whose last token is next fed) could draft now: its prompt lookup's
        guess, as long as its answer and context leave room for."""
        if slot.drafts is None:
            slot.drafts = Row(slot.prompt_ids, self.prior(slot.params.temperature))
        row = slot.drafts
        for token in slot.out_ids[len(row.grams.ids) - len(slot.prompt_ids):]:
            row.grams.push(token)
        room = min(MAX_DRAFT, slot.max_new - len(slot.out_ids) - 1, slot.context - slot.pos - 2)
        return row.grams.propose(room) if room > 0 else []

    def idle(self, slot: Any) -> None:
        """A step in which ``slot`` drafted nothing: its rate drifts towards its temperature's, and that back
        towards one in two."""
        band_counts = self.seen.get(band(slot.params.temperature))
        if band_counts is not None:
            band_counts[0] = 1.0 + (band_counts[0] - 1.0) * DRIFT
            band_counts[1] = 2.0 + (band_counts[1] - 2.0) * DRIFT
        slot.drafts.idle(self.prior(slot.params.temperature))

    def guess(self, slot: Any) -> list[int]:
        """The drafts worth checking for ``slot`` decoding alone now: [] when none pay (its rate then drifts)."""
        guess = self.candidates(slot)
        count = length(slot.drafts.rate, self.costs, len(guess))
        if not count:
            self.idle(slot)
        return guess[:count]

    def checks(self, runner: Any) -> Iterator[None]:
        """Idle chores after the runner's own (the C++ step in): whether its steps of several columns and rows are
        the single steps on this machine (``widest``), checked while idle (a second or so on a loaded 2-core box),
        not at the first step an answer drafts in."""
        if self.on and runner.native:
            for rows in (1, 2):
                yield
                self.widest(runner, rows)

    def widest(self, runner: Any, rows: int) -> int:
        """The widest drafted step the runner checks bit for bit for ``rows`` rows (0: none): ``MAX_WIDTH``
        columns, or fewer where a wider one is not the single steps on this machine (products that change their
        kernel past a crossover); one row's ``MAX_DRAFT + 1`` at most alone."""
        if rows == 1:
            return MAX_DRAFT + 1 if runner.verifies(MAX_DRAFT + 1) else 0
        for width in (MAX_WIDTH, MAX_WIDTH // 2):
            if rows < width and runner.verifies(width):
                return width if runner.verifies_rows() else 0
        return 0

    def step(self, rows: list, may: list, kv: Any, runner: Any) -> tuple[Any, list] | None:
        """A step with drafts for ``rows`` (the batch's, in ``kv``'s order), when they pay (None: not taken):
        each row of ``may`` that drafts feeds its last token and its drafts, the others their last token, in one
        C++ step (``runner.verify_rows``), each column bit for bit what a step of that row alone gives. A drafting
        row's tokens are sampled column by column with its own sampler and generator, as single steps would make
        them, up to the first draft the answer did not make; ``kv`` keeps the columns that hold each row's
        tokens (``runner.settle``). -> (every row's first column's logits, as a step without drafts gives them,
        for the rows that drafted none; (each drafting row, its tokens to take in order)). Never for a grammar's
        answer or one that reports log probabilities, nor without a C++ step that verifies."""
        if not self.on:
            return None
        widest = self.widest(runner, len(rows))
        if not widest or len(rows) >= widest:
            return None
        allowed = [s for s in rows if any(s is m for m in may) and s.matcher is None and s.params.logprobs is None
                   and getattr(s, "guard", None) is None]
        guesses = {id(s): self.candidates(s) for s in allowed}
        rates = [s.drafts.rate if id(s) in guesses else 0.0 for s in rows]
        most = [len(guesses.get(id(s), ())) for s in rows]
        counts = plan(rates, most, self.costs, widest) if any(most) else [0] * len(rows)
        for s, count in zip(rows, counts):
            if id(s) in guesses and not count:
                self.idle(s)
        if not any(counts):
            return None
        fed = [[s.last, *guesses[id(s)][:count]] if count else [s.last] for s, count in zip(rows, counts)]
        started = time.monotonic()
        logits = runner.verify_rows(kv, fed, [s.pos for s in rows])
        at = [0]
        for tokens in fed:
            at.append(at[-1] + len(tokens))
        going = [r for r, count in enumerate(counts) if count]
        made: dict[int, list] = {r: [] for r in going}  # by row
        column = 0
        while going:  # column by column, every drafting row still going at once
            tokens = sample_rows(logits[[at[r] + column for r in going]], [rows[r].params for r in going],
                                 [rows[r].generator for r in going], native=runner.sampler())
            still = []
            for r, token in zip(going, tokens):
                made[r].append(token)
                if isinstance(token, int) and column < counts[r] and token == fed[r][column + 1]:
                    still.append(r)
            going, column = still, column + 1
        kept = [len(made[r]) if count else 1 for r, count in enumerate(counts)]
        runner.settle(kv, kept, max(len(t) for t in fed))
        self.costs.measured(at[-1], time.monotonic() - started)
        for s, count, k in zip(rows, counts, kept):
            s.pos += k
            if not count:
                continue
            right = k - 1
            s.drafts.checked(count, right)
            seen = self.seen.setdefault(band(s.params.temperature), [1.0, 2.0])
            seen[0] = seen[0] * SEEN_DECAY + right
            seen[1] = seen[1] * SEEN_DECAY + right + (1 if right < count else 0)
            self.drafted += count
            self.accepted += right
        self.steps += 1
        return logits[at[:-1]], [(rows[r], tokens) for r, tokens in made.items()]

    def stats(self) -> dict:
        return {"draft_steps": self.steps, "drafted_tokens": self.drafted, "draft_accepted_tokens": self.accepted}
