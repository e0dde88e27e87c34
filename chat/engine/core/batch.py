"""The rows decoding together: joining the batch, one decode step a turn (with drafts where they pay), every row's
next token sampled in one pass, rows ended (their KV kept in the prefix cache for the next turn).

The engine's loop (``local.py``) runs the scheduler's plan: one ``step`` an iteration (its cut rows, its drafts,
every row's next token), then each prefilled job ``join``s. The rows' order is the KV buffer's (row i is row i
of ``kv``), so the rows decoding and the buffer are this object's alone; the scheduler plans over them. Every
event a row emits goes through ``delta`` and ``done`` below.
"""
from __future__ import annotations

import logging
import time

import torch

from ..base import Generation
from ..events import Delta, Done
from ..kv.buffer import KVBuffer, joined
from ..kv.prefix import PrefixCache
from ..model.prefill import PrefillJob
from ..model.runner import ModelRunner
from ..model.sampling import sample_rows
from . import drafts, grammar
from .scheduler import Plan
from .slot import Slot

log = logging.getLogger(__name__)


class Batch:
    """The decoding rows (row i is row i of ``kv``), the batch's KV buffer, a decode step's measured cost."""

    runner: ModelRunner  # these three once the model is in (``loaded``)
    grammars: grammar.Grammars
    eos_ids: frozenset

    def __init__(self, prefix: PrefixCache, drafter: drafts.Drafter) -> None:
        self.rows: list[Slot] = []
        self.kv: KVBuffer | None = None
        self.prefix = prefix
        self.drafter = drafter
        self.step_s = 0.05  # measured: a decode step's forward (moving average)
        self.ahead: dict[Slot, int] = {}  # a drafting row's KV columns past the token it takes (``_drafted``)
        self.tokens_generated = 0

    def loaded(self, runner: ModelRunner, grammars: grammar.Grammars, eos_ids: frozenset) -> None:
        self.runner, self.grammars, self.eos_ids = runner, grammars, eos_ids

    def join(self, job: PrefillJob) -> None:
        """Move a prefilled job's rows into the batch (in place) and sample their first tokens."""
        logits, job.logits = job.logits, None
        assert logits is not None
        kept = []
        for r, slot in enumerate(job.slots):
            if slot.gen.cancel_reason:
                done(slot.gen, slot.gen.cancel_reason, slot)
            else:
                kept.append(r)
        if not kept:
            return
        self.kv = joined(self.kv, job.kv, kept, reads_padding=not self.runner.native)  # the C++ step reads none
        slots = [job.slots[r] for r in kept]
        self.rows += slots
        if job.scores is not None:
            for r in kept:  # every prompt token's log probability, before the answer
                job.slots[r].gen.emit(Delta("", prompt_logprobs=grammar.prompt_entries(self.grammars, job.scores[r])))
        rows = logits[kept] if len(kept) < job.rows else logits
        self._accept_all(slots, rows)

    def step(self, plan: Plan) -> None:
        """The plan's decode step: its ``cut`` rows end, then every other row decodes one token, or the rows of its
        ``drafts`` several (when the drafter has guesses worth checking: ``drafts.Drafter.step``)."""
        for slot, reason in plan.cut:
            if slot in self.rows:  # (not already ended)
                self.finish(slot, reason)
        if not self.rows:
            return
        assert self.kv is not None
        started = time.monotonic()
        drafted = self.drafter.step(self.rows, plan.drafts, self.kv, self.runner) if plan.drafts else None
        if drafted is not None:  # its cost is this iteration's decode step's: prefill beside it is sized by it
            self.step_s += (time.monotonic() - started - self.step_s) / 8
            self._drafted(*drafted)
            return
        started = time.monotonic()
        logits = self.runner.decode(self.kv, [s.last for s in self.rows], [s.pos for s in self.rows])
        spent = time.monotonic() - started
        self.step_s += (spent - self.step_s) / 8  # a moving average
        self.drafter.costs.measured(len(self.rows), spent)
        for slot in self.rows:
            slot.pos += 1
        self._accept_all(list(self.rows), logits)

    def _drafted(self, first: torch.Tensor, made: list[tuple[Slot, list]]) -> None:
        """A step with drafts ran (``drafts.Drafter.step``): the rows that drafted nothing take their token from
        their column's logits (``first``: every row's, in order) as a step without drafts; each drafting row its
        tokens in order, until one ends it. While it takes them its KV holds columns past the token it takes
        (``ahead``): a row that ends there keeps only those before, as without drafts."""
        rows = list(self.rows)
        drafting = {id(slot) for slot, _ in made}
        plain = [r for r, slot in enumerate(rows) if id(slot) not in drafting]
        if plain:
            self._accept_all([rows[r] for r in plain], first[plain])
        for slot, tokens in made:
            for j, token in enumerate(tokens):
                self.ahead[slot] = len(tokens) - 1 - j
                if not self._take(slot, token):
                    break
            self.ahead.pop(slot, None)

    def _take(self, slot: Slot, token: int | str) -> bool:
        """``slot``'s next token, or why sampling failed (the row ends with ``error``); whether the row goes on."""
        if isinstance(token, str):
            self.finish(slot, "error", token)
            return False
        self._accept(slot, token)
        return slot in self.rows

    def _accept_all(self, slots: list[Slot], logits: torch.Tensor) -> None:
        """Sample every row's next token in one pass, then emit each row's text; a row whose sampling fails
        ends alone with ``error`` (``sample_rows``). Log probabilities come from the raw logits; a grammar's
        mask (-inf) goes on before either sampler sees them. Rows asked for no tokens (a scored prompt) end
        here, unsampled."""
        if any(s.max_new == 0 for s in slots):
            keep = [j for j, s in enumerate(slots) if s.max_new > 0]
            for s in slots:
                if s.max_new == 0:
                    self.finish(s, "length")
            slots, logits = [slots[j] for j in keep], logits[keep]
            if not slots:
                return
        scores = grammar.log_probs(logits, slots)
        failed = grammar.apply_masks(logits, slots)
        tokens = grammar.settle(slots, sample_rows(logits, [s.params for s in slots], [s.generator for s in slots],
                                                   native=self.runner.sampler()))
        for j, (slot, token) in enumerate(zip(slots, tokens)):
            if slot in failed:  # its token was drawn unconstrained: never emitted
                self._take(slot, grammar.failure_message(slot.matcher))
                continue
            if scores is not None and j in scores and not isinstance(token, str) and token not in self.eos_ids:
                slot.pending.append(grammar.entry(self.grammars, scores[j], token, slot.params.logprobs or 0))
            self._take(slot, token)

    def _accept(self, slot: Slot, token: int) -> None:
        """Take a row's next token and emit its text; finish the row if it ended."""
        text, reason = slot.take(token, self.eos_ids)
        if token not in self.eos_ids and reason != "error":
            self.tokens_generated += 1
        delta(slot, text)
        if reason:
            self.finish(slot, reason, slot.failure)  # a failure: why the grammar ended it (``error``)

    def finish(self, slot: Slot, reason: str, message: str | None = None) -> None:
        """End a row: flush its text, keep its KV for the next turn, emit ``done``."""
        if reason == "error":
            log.warning("an answer ended with error after %d tokens: %s", len(slot.out_ids), message)
        else:
            delta(slot, slot.flush(), last=True)
        if slot in self.rows:
            assert self.kv is not None
            r = self.rows.index(slot)
            if slot.gen.key and reason != "error":
                keys, values = self.kv.row(r)
                ahead = self.ahead.pop(slot, 0)
                if ahead:  # columns of drafts past its end
                    keys, values = ([t[:, :, :t.shape[2] - ahead] for t in ts] for ts in (keys, values))
                fed = slot.prompt_ids + slot.out_ids
                self.prefix.put(slot.gen.key, fed[:max(k.shape[2] for k in keys)], keys, values,  # windowed: fewer
                                slot.params.cache_salt)
            self._remove_row(r)
        done(slot.gen, reason, slot, message)

    def _remove_row(self, r: int) -> None:
        """The last row takes row ``r``'s place, in the list as in the buffer."""
        assert self.kv is not None
        self.kv.remove_row(r)
        self.rows[r] = self.rows[-1]
        self.rows.pop()
        if not self.rows:
            self.kv = None

    def end(self, reason: str) -> None:
        """End every row with ``reason`` (after a failure, ``error``, touching no KV: it may be half-updated)."""
        if reason == "error":
            rows, self.rows, self.kv = self.rows, [], None
            for slot in rows:
                done(slot.gen, reason, slot)
        while self.rows:
            self.finish(self.rows[-1], reason)


# ---- events: every emit goes through these


def delta(slot: Slot, text: str, last: bool = False) -> None:
    event = slot.delta(text, last)
    if event is not None:
        slot.gen.emit(event)


def done(gen: Generation, reason: str, slot: Slot | None = None, message: str | None = None) -> None:
    gen.emit(slot.done(reason, message) if slot else Done.build(reason, 0, 0, gen.submitted_at, None, 0, message,
                                                               message))
