"""Who runs next: the local engine's queue, admission, gathering and prefill budget, decided here and
carried out by the engine (events) and its model runner (forwards): each iteration's ``Plan``.

Requests reach the engine through an inbox (a deque producers only append to);
everything else here is the engine thread's own. Each iteration spends one
chunk of at most ``CHAT_PREFILL_CHUNK`` prompt tokens, and about ``STALL``
decode steps' worth of time, on newcomers (all at once when nobody is decoding;
more when more owners wait to start than decode), so a long prompt never stalls
running streams for long. An idle engine lets requests sent together land
before it starts, so they share one prefill.

Prefill is shared between owners (a generation's ``owner``: its client's address), not between
requests: seven long prompts from one address count as one owner waiting, get one owner's share
of the time between decode steps, and the owner that has had the least prefill (a prompt under way
not counted against its own) goes next, the shortest prompt first among equals. What
prefills at once is bounded in memory: at most PREFILL_TOKENS prompt tokens in prefill together
(more wait in the queue) and PREFILL_FORWARD_TOKENS in one forward.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...concurrency import Counter, Wakeup
from ...config import Settings
from ...errors import EngineError
from ..base import Generation
from ..kv.prefix import PrefixCache
from ..model import sampling
from ..model.prefill import MIN_CHUNK, PrefillJob
from .slot import Slot

STALL = 2.0  # a prefill chunk between two decode steps takes at most about this many decode steps
GATHER_S = 0.05  # the most an idle engine waits for requests being submitted along with the first
PREFILL_TOKENS = 4096  # prompt tokens (rows x width) in prefill at once, at least (or 2 contexts)
PREFILL_FORWARD_TOKENS = 4096  # prompt tokens in one prefill forward, even with nobody to stall


def owner(gen: Generation) -> str:
    """Whose generation it is (its address); one without an owner is its own."""
    return gen.owner or f"#{gen.serial}"


@dataclass(eq=False)
class Request:
    """A generation waiting for the engine: what only the engine knows of it."""

    gen: Generation
    prompt_ids: list  # fitted before it reaches the scheduler (``LocalEngine.prepare``)
    matcher: object = None  # the grammar's matcher (engine/core/grammar.py), compiled with the prompt ids
    position: int | None = None  # the queue position last told to the consumer


@dataclass(eq=False)
class Chunk:
    """A prefill forward decided: ``columns`` more prompt positions of ``job``'s rows; the runner that carries
    it out says what it cost (``spent``, seconds), from which the next chunk is sized."""

    job: PrefillJob
    columns: int
    spent: float = 0.0


@dataclass(eq=False)
class Plan:
    """One iteration as the scheduler decided it; the engine carries it out (``LocalEngine._iterate``): who
    ends, who starts and who waits (events), who prefills how much, who is cut, who decodes, who drafts.

    ``ended``: (generation, reason, slot or None) to end unstarted (cancelled while waiting or prefilling);
    ``refused``: (generation, error); ``started``: slots admitted (their prefill is under way);
    ``queued``: (generation, position) whose queue position changed. Prefill: the chunks
    ``Scheduler.chunks`` hands out within ``budget`` tokens and ``target`` seconds, each sized from what the
    last one cost. Then the decode step: ``cut`` rows end first (cancelled, out of time), every other row
    decodes, and the rows in ``drafts`` may feed drafted tokens (``drafts.Drafter``) instead of one.
    """

    decoding: int  # rows in the decode step
    step_s: float  # a decode step's measured cost
    cut: list[tuple[Slot, str]] = field(default_factory=list)
    drafts: list[Slot] = field(default_factory=list)
    answering: bool = False  # an answer someone waits on decodes: background work waits (``_next_waiting``)
    ended: list[tuple[Generation, str, Slot | None]] = field(default_factory=list)
    refused: list[tuple[Generation, EngineError]] = field(default_factory=list)
    started: list[Slot] = field(default_factory=list)
    queued: list[tuple[Generation, int]] = field(default_factory=list)
    budget: int = 0  # prompt tokens left to this iteration's prefill
    target: float = 0.0  # seconds of prefill this iteration aims at
    seconds: float = 0.0  # of which still left
    share: int = 1  # owners waiting to start per owner decoding
    over: bool = False  # no more prefill this iteration


class Scheduler:
    """The queue of one ``LocalEngine`` and its prompts being prefilled: it decides, the engine runs.

    Each iteration's ``plan`` cuts the decoding rows that end, takes new requests, admits what fits, and then
    hands out prefill chunks within the iteration's budget (``chunks``). Requests
    reach it prepared (prompt ids fitted, grammar compiled: ``LocalEngine.prepare``, off the engine thread);
    events and forwards are the engine's. It plans once ``loaded`` told it the model's KV shape.
    """

    def __init__(self, settings: Settings, prefix: PrefixCache) -> None:
        self.settings = settings
        self.prefix = prefix
        self.dims: tuple | None = None  # a KV buffer's (layers, heads, head dim, dtype, device): ``loaded``
        self.tokenizer: Any = None  # the slots' (their text)
        self.stops: tuple[str, ...] = ()  # the template's stop text, besides each request's own
        self.grammars: Any = None  # core/grammar.py's Grammars, once loaded
        # Whether a forward of many rows costs little more than one of a few (dense products): then newcomers
        # arriving together are prefilled in one forward rather than each from its preamble. The engine keeps
        # it current (the idle chores may move the weights onto the block products).
        self.wide_prefill = False
        self.inbox: collections.deque = collections.deque()  # producers append, the engine pops
        self.waiting: collections.deque = collections.deque()  # Requests; engine thread only
        self.jobs: collections.deque = collections.deque()  # prefills in progress; engine thread only
        self.joining: collections.deque = collections.deque()  # jobs prefilled, to join the batch
        self.wake = Wakeup()
        self.arriving = Counter()  # submits still fitting their prompt: see gather
        self.prefilling = 0  # rows in jobs and joining, kept by the engine thread for other threads to read
        self.token_s = 0.0  # seconds a prompt token costs in a chunk beside decoding rows (measured)
        self.spent: dict[str, int] = {}  # prompt tokens prefilled per owner since prefill last went idle
        self.budget_tokens = max(PREFILL_TOKENS, 2 * self.settings.context_tokens)

    def loaded(self, dims: tuple, tokenizer: Any, wide_prefill: bool, stops: tuple[str, ...] = (),
               grammars: Any = None) -> None:
        """The model is in: the shape of its KV buffers, its tokenizer (the slots'), how its prefill scales, the
        text its template ends an answer at (a base model's ChatML markers), the grammars' token table (a
        constrained slot's budget: ``Slot.constrain``)."""
        self.dims, self.tokenizer, self.wide_prefill, self.stops = dims, tokenizer, wide_prefill, stops
        self.grammars = grammars

    # ---- any thread

    def queued(self) -> int:
        """Requests waiting to start (len() only: atomic, unlike iterating)."""
        return len(self.waiting) + len(self.inbox)

    def put(self, request: Request) -> None:
        self.inbox.append(request)

    def drain_inbox(self) -> list:
        """Every request still in the inbox (the engine ends them)."""
        taken = []
        while True:
            try:
                taken.append(self.inbox.popleft())
            except IndexError:
                return taken

    # ---- the engine thread

    def plan(self, rows: list[Slot], step_s: float, stopping: Callable[[], object]) -> Plan:
        """This iteration: cut the decoding ``rows`` that end (a step of them costs ``step_s``), say who drafts,
        take new requests (gathering those sent together while idle), admit what fits, and set the prefill
        budget beside the rows that go on decoding."""
        cut = self.cut(rows)
        decoding = [slot for slot in rows if all(slot is not c for c, _ in cut)] if cut else rows
        # Every decoding row may draft: the drafter feeds those whose guesses pay, for the step's measured cost.
        plan = Plan(len(decoding), step_s, cut, list(decoding),
                    answering=any(not s.params.background for s in decoding))
        self.take_inbox(plan)
        # Background work (titles) decoding or prefilling does not count: users who send together while only
        # titles run are still gathered into one prefill.
        if self.waiting and not plan.answering and not any(
                not s.params.background for job in self.jobs for s in job.slots):
            self.gather(plan, stopping)
        self.admit(plan)
        if not self.jobs:
            self.spent.clear()
            return plan
        # A chunk per decode step bounds the running rows' stall; when more owners (addresses) wait
        # for a first token than decode, they get proportionally more (the stall then hurts fewer).
        # Owners, not requests: one address's seven prompts are one owner's share.
        # (rounded up: 5 owners waiting beside 3 decoding get 2 shares, not 1)
        waiting = {owner(s.gen) for job in self.jobs for s in job.slots}
        plan.share = max(1, -(-len(waiting) // max(1, len({owner(s.gen) for s in rows}))))
        plan.budget = self.settings.prefill_chunk * plan.share
        # The budget is also one of time: a chunk costs more the deeper its prompt (attention), so
        # its size follows the measured cost, to stall running rows at most ~STALL decode steps.
        plan.target = plan.seconds = STALL * step_s * plan.share
        return plan

    def busy(self, rows: list[Slot]) -> bool:
        """Anything decoding (``rows``) or prefilling."""
        return bool(rows or self.jobs)

    @staticmethod
    def cut(rows: list[Slot]) -> list[tuple[Slot, str]]:
        """Decoding rows to end before the next decode step, and why (cancelled, out of time)."""
        now = time.monotonic()
        return [(slot, slot.gen.cancel_reason or "timeout") for slot in rows
                if slot.gen.cancel_reason or now >= slot.deadline]

    def take_inbox(self, plan: Plan) -> None:
        """Move new requests into the engine's own queue; end waiters that were cancelled."""
        self.waiting.extend(self.drain_inbox())
        if any(r.gen.cancel_reason for r in self.waiting):
            # One pass: a cancel landing between two scans would lose the generation.
            kept: collections.deque = collections.deque()
            for request in self.waiting:
                reason = request.gen.cancel_reason
                if reason:
                    plan.ended.append((request.gen, reason, None))
                else:
                    kept.append(request)
            self.waiting = kept

    def gather(self, plan: Plan, stopping: Callable[[], object]) -> None:
        """Idle, with work to start: let requests submitted meanwhile (still fitting) land first.

        Users who send at the same moment are then prefilled in one forward, which costs far less
        than one after the other (8 prompts of 60 tokens: ~2.7x one, not 8x), so the last one's
        first token does not wait for the others' prefills. A lone request waits for nothing.
        """
        deadline = time.monotonic() + GATHER_S
        while self.arriving.value and not stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.wake.wait(left)
            self.take_inbox(plan)

    def count(self) -> None:
        self.prefilling = sum(len(j.slots) for j in self.jobs) + sum(len(j.slots) for j in self.joining)

    def _tokens(self) -> int:
        """Prompt tokens (rows x width) of the jobs prefilling: what their buffers and forwards hold."""
        return sum(job.rows * job.tokens.shape[1] for job in self.jobs)

    def _next_waiting(self, plan: Plan, fresh: list) -> Request | None:
        """The next waiter to start: the oldest of an owner with nothing in prefill, else the oldest;
        None while the prefill memory budget is spent (someone is always let in). Background work (a title)
        waits while any answer someone waits on decodes, prefills or waits to start."""
        answers = [r for r in self.waiting if not r.gen.params.background]
        if len(answers) < len(self.waiting) and (
                answers or plan.answering or any(not s.params.background for s in fresh)
                or any(not s.params.background for job in self.jobs for s in job.slots)):
            if not answers:
                return None
            candidates = answers
        elif not answers:
            # Background work only, one at a time: a few titles prefilled together would make one long forward
            # that a user arriving meanwhile waits behind (a forward is never interrupted).
            if fresh or self.jobs:
                return None
            candidates = list(self.waiting)
        else:
            candidates = list(self.waiting)
        busy = {owner(s.gen) for job in self.jobs for s in job.slots} | {owner(s.gen) for s in fresh}
        request = next((r for r in candidates if owner(r.gen) not in busy), candidates[0])
        size = len(request.prompt_ids or ())
        held = self._tokens() + sum(len(s.prompt_ids) for s in fresh)
        if (self.jobs or fresh) and held + size > self.budget_tokens:
            return None
        self.waiting.remove(request)
        return request

    def admit(self, plan: Plan) -> None:
        """Start prefilling waiters while the batch has room; tell the rest their position."""
        room = self.settings.max_batch - plan.decoding - self.prefilling
        fresh: list[Slot] = []
        started = plan.started
        while self.waiting and room > 0:
            request = self._next_waiting(plan, started)
            if request is None:
                break
            gen = request.gen
            wrong = sampling.problem(gen.params)
            if wrong is not None:  # refused alone: the batch never sees these parameters
                plan.refused.append((gen, EngineError(wrong, "bad_message", 400)))
                continue
            room -= 1
            slot = Slot(gen, request.prompt_ids, self.tokenizer, self.settings, self.stops)
            slot.constrain(request.matcher, self.grammars)
            started.append(slot)
        # Several newcomers without a conversation's KV arriving together share their chunks where prefill
        # runs on dense products (one forward for all: cheaper than a forward each, even from a shared
        # preamble); on the block kernels, whose many-row forwards cost in proportion to their rows, and for
        # a lone one, each starts from the longest prefix held (its system prompt's shared preamble). A
        # seeded, sampled prompt never takes a preamble: whether one is held when it arrives must not change
        # its answer (its KV, prefilled alone, rounds apart); a scored prompt (every position's log
        # probability) reuses nothing.
        burst = self.wide_prefill and sum(not _alone(s) and s.gen.key not in self.prefix.entries
                                               for s in started) > 1
        for slot in started:
            gen, seeded = slot.gen, _seeded(slot)
            scored = gen.params.prompt_logprobs is not None
            reused = None if scored else self.prefix.take(gen.key, slot.prompt_ids, shared=not seeded and not burst,
                                                            salt=gen.params.cache_salt)
            if reused is None and not _alone(slot):
                fresh.append(slot)
                continue
            # A seeded, sampled prompt is prefilled on its own, as it would be alone: a prompt padded
            # into others' forward comes out a rounding error apart, which sampling can amplify.
            slot.reused = reused[2] if reused else 0
            self._add_job([slot], reused, shared=False)
        if fresh:  # newcomers arriving together share their chunks
            self._add_job(fresh, None)
        for position, request in enumerate(self.waiting, 1):
            if request.position != position:
                request.position = position
                plan.queued.append((request.gen, position))

    def _add_job(self, slots: list[Slot], reused: tuple | None, shared: bool = True) -> None:
        last = self.jobs[-1] if self.jobs else None
        if shared and reused is None and last is not None and last.shared and last.done == 0:
            # Fresh prompts still waiting for their first chunk: fewer, wider forwards.
            self.jobs.pop()
            slots = last.slots + slots
        assert self.dims is not None
        job = PrefillJob([s.prompt_ids for s in slots], self.dims, reused)
        job.slots = slots
        job.score = max((s.params.prompt_logprobs for s in slots if s.params.prompt_logprobs is not None),
                        default=None)
        job.shared = shared and reused is None
        self.jobs.append(job)
        self.count()

    def chunks(self, plan: Plan) -> Iterator[Chunk]:
        """The plan's prefill forwards, one at a time within its budget, the job ``_next_job`` says first, each
        sized from what the last one cost (the runner sets ``Chunk.spent`` before asking for the next); jobs
        whose every prompt was cancelled end here, finished ones wait to join the batch (``take_joining``)."""
        step_s, target = plan.step_s, plan.target
        while not plan.over and self.jobs and plan.budget > 0 and plan.seconds > 0:
            job = self._next_job()
            if all(s.gen.cancel_reason for s in job.slots):
                self.jobs.remove(job)
                self.count()
                plan.ended += [(slot.gen, slot.gen.cancel_reason, slot) for slot in job.slots]
                continue
            background = all(s.params.background for s in job.slots)
            # Only background rows (titles) decoding stall nobody who waits: an answer's prompt then goes whole,
            # as if nothing decoded (the titles wait a step).
            decoding = plan.decoding if plan.answering or background else 0
            if decoding and not job.columns and self.token_s:
                # A job's first chunk: sized from what earlier chunks cost (at their depth, so
                # no more than this one, which starts the prompt), not just the token budget.
                job.columns = max(MIN_CHUNK, int((target - step_s) / (self.token_s * job.rows)))
            # Nobody decoding means nobody to stall: the whole prompt at once (memory allowing).
            columns = job.chunk(plan.budget) if decoding else min(job.remaining,
                                                                  max(1, PREFILL_FORWARD_TOKENS // job.rows))
            if decoding and self.token_s:
                # The job's rows share the tokens the time target allows (at least MIN_CHUNK a share):
                # an owner's seven prompts in one job advance together no faster than one would.
                allowed = max(MIN_CHUNK * plan.share, int((target - step_s) / self.token_s))
                columns = min(columns, max(1, allowed // job.rows))
            if background:
                # Background work (a title) in chunks of about STALL decode steps' time (CHAT_PREFILL_CHUNK
                # tokens at most), even when nothing decodes: an answer arriving meanwhile waits for one at most.
                tokens = self.settings.prefill_chunk
                if self.token_s and step_s:
                    tokens = min(tokens, max(MIN_CHUNK, int(STALL * step_s / self.token_s)))
                columns = min(columns, max(1, tokens // job.rows))
            if len(job.slots) == 1 and _seeded(job.slots[0]):
                # A seeded, sampled prompt is cut the same way whoever else runs (CHAT_PREFILL_CHUNK columns at a
                # time, alone too): chunks cut by measured time would round it apart from its prefill alone, which
                # sampling can amplify into another answer.
                columns = min(job.remaining, self.settings.prefill_chunk)
            # (never past the prompt: the budget, the owner's share and the measured token cost count real columns)
            chunk = Chunk(job, min(columns, job.remaining))
            yield chunk
            self._ran(plan, chunk)

    def _ran(self, plan: Plan, chunk: Chunk) -> None:
        """``chunk`` ran (in ``chunk.spent`` seconds): measure, move its job on to join once done."""
        job, columns, spent = chunk.job, chunk.columns, chunk.spent
        if plan.decoding:
            plan.budget -= columns * job.rows
            plan.seconds -= spent
            job.measured(columns, spent, plan.step_s, plan.target)
        # (alone, a forward's fixed cost counts as its tokens': an estimate on the safe side; a prompt's
        # last few tokens cost about a decode step's fixed part alone, which says nothing of a token's cost)
        if columns * job.rows >= MIN_CHUNK or not self.token_s:
            self.token_s = max(spent - (plan.step_s if plan.decoding else 0), 1e-4) / (columns * job.rows)
        for slot in job.slots:
            self.spent[owner(slot.gen)] = self.spent.get(owner(slot.gen), 0) + columns
        if job.logits is not None:
            self.jobs.remove(job)
            self.joining.append(job)
        if not plan.decoding or plan.seconds < plan.target / 2:
            # Decoding: another forward now would stall the running rows past the target. Not
            # decoding: look for newcomers (another owner's) before the next forward.
            plan.over = True

    def _next_job(self):
        """The job of the owner that has had the least prefill, not counting this job's own progress, then the
        one with the fewest tokens left, then the oldest; background work (a title) only when no answer's prompt
        waits for a chunk. A prompt under way is not cut into turns with its equals' (which would give each of
        them its first token only once all were done), and a short prompt passes a long one, whose owner's
        prompts before it count against it."""
        def served(job: PrefillJob) -> tuple[bool, int, int]:
            return (all(s.params.background for s in job.slots),
                    min(self.spent.get(owner(s.gen), 0) for s in job.slots) - job.done, job.remaining * job.rows)
        return min(self.jobs, key=served)  # min keeps the first (oldest) of equals

    def take_joining(self) -> Iterator[PrefillJob]:
        """Prefilled jobs, oldest first (each with its last position's ``logits``)."""
        while self.joining:
            yield self.joining.popleft()
            self.count()

    def take_all(self) -> list:
        """Every job prefilling or joining (the engine ends them)."""
        jobs = list(self.jobs) + list(self.joining)
        self.jobs.clear()
        self.joining.clear()
        self.count()
        return jobs


def _seeded(slot: Slot) -> bool:
    """A seeded, sampled answer: prefilled as it would be alone, whoever else arrives."""
    return slot.params.seed is not None and slot.params.temperature > 0


def _alone(slot: Slot) -> bool:
    """Prefilled in a job of its own: a seeded, sampled answer, or a scored prompt (every position's logits)."""
    return _seeded(slot) or slot.params.prompt_logprobs is not None
