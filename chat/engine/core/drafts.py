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
from collections.abc import Callable
from typing import Any

from ..model.sampling import sample_rows

MIN_N, MAX_N = 2, 4  # n-gram lengths looked up, longest first
MAX_DRAFT = 8  # tokens drafted at most in one step
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


def guessed(width: int) -> float:
    """A step of ``width`` columns against one of one column, before any is measured: each more column a third."""
    return 1 + (width - 1) / 3


class Costs:
    """A step's running cost by its width (columns), measured; widths not seen yet are estimated. A wide
    width dearer than ``guessed`` drifts back towards the guess with each one-column step, so a draft
    length turned off by one slow wide step is tried again (and measured again)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def measured(self, width: int, seconds: float) -> None:
        known = self.seconds.get(width)
        self.seconds[width] = seconds if known is None else known + (seconds - known) / 8
        if width == 1:
            for w, cost in self.seconds.items():
                guess = self.seconds[1] * guessed(w)
                if cost > guess:
                    self.seconds[w] = guess + (cost - guess) * DRIFT

    def of(self, width: int) -> float:
        if width in self.seconds:
            return self.seconds[width]
        one = self.seconds.get(1, 0.01)
        wider = [w for w in self.seconds if w > 1]
        if not wider:  # a guess until a wide step is measured
            return one * guessed(width)
        near = min(wider, key=lambda w: abs(w - width))  # linear from one column through the nearest width seen
        return one + (self.seconds[near] - one) * (width - 1) / (near - 1)


def length(rate: float, costs: Costs, most: int) -> int:
    """The number of drafted tokens (0 to ``most``) that makes the most tokens per second, when each is
    right with probability ``rate`` (given the ones before it were)."""
    best, best_speed = 0, 1.0 / costs.of(1)
    made = 1.0
    for k in range(1, most + 1):
        made += rate ** k  # tokens a step of k drafts makes, on average
        speed = made / costs.of(k + 1)
        if speed > best_speed * 1.02:  # a clear gain only: a draft costs when it misses
            best, best_speed = k, speed
    return best


class Drafter:
    """The engine's drafting: what to guess for a lone row and how many, the steps' costs, and the counts
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

    def guess(self, slot: Any) -> list[int]:
        """The drafts worth checking for ``slot`` (an engine ``Slot`` whose last token is next fed) now: []
        when none pay (its rate then drifts back towards the prior)."""
        if slot.drafts is None:
            slot.drafts = Row(slot.prompt_ids, self.prior(slot.params.temperature))
        row = slot.drafts
        for token in slot.out_ids[len(row.grams.ids) - len(slot.prompt_ids):]:
            row.grams.push(token)
        room = min(MAX_DRAFT, slot.max_new - len(slot.out_ids) - 1, slot.context - slot.pos - 2)
        guess = row.grams.propose(room) if room > 0 else []
        count = length(row.rate, self.costs, len(guess))
        if not count:  # the row's rate drifts towards its temperature's, and that back towards one in two
            band_counts = self.seen.get(band(slot.params.temperature))
            if band_counts is not None:
                band_counts[0] = 1.0 + (band_counts[0] - 1.0) * DRIFT
                band_counts[1] = 2.0 + (band_counts[1] - 2.0) * DRIFT
            row.idle(self.prior(slot.params.temperature))
        return guess[:count]

    def step(self, slot: Any, kv: Any, runner: Any, take: Callable[[Any, int | str], bool]) -> bool:
        """A lone row's step with drafts, when they pay (whether it ran): its last token and the drafts fed at
        once (``runner.verify``), then its tokens sampled column by column as single steps would make them,
        each handed to ``take(slot, token or error)`` (False: the row ended), up to the first draft the answer
        did not make. ``kv`` keeps the columns that hold the answer's tokens; the others are written over. Never
        for a grammar's answer or one that reports log probabilities, nor without a C++ step that verifies."""
        if (not self.on or slot.matcher is not None or slot.params.logprobs is not None
                or not runner.verifies(MAX_DRAFT + 1)):
            return False
        guess = self.guess(slot)
        if not guess:
            return False
        started = time.monotonic()
        logits = runner.verify(kv, [slot.last, *guess], slot.pos)
        self.costs.measured(len(guess) + 1, time.monotonic() - started)
        right = 0
        for j in range(len(guess) + 1):
            kv.advance(1)  # column j holds one of the answer's tokens: its last, or a draft it made
            slot.pos += 1
            token = sample_rows(logits[j:j + 1], [slot.params], [slot.generator], native=runner.sampler())[0]
            if not take(slot, token) or j == len(guess) or token != guess[j]:
                break
            right += 1
        kv.close(len(guess) + 1)  # the drafts the answer did not make
        slot.drafts.checked(len(guess), right)
        seen = self.seen.setdefault(band(slot.params.temperature), [1.0, 2.0])
        seen[0] = seen[0] * SEEN_DECAY + right
        seen[1] = seen[1] * SEEN_DECAY + right + (1 if right < len(guess) else 0)
        self.steps += 1
        self.drafted += len(guess)
        self.accepted += right
        return True

    def stats(self) -> dict:
        return {"draft_steps": self.steps, "drafted_tokens": self.drafted, "draft_accepted_tokens": self.accepted}
