"""The inference engine: the only place that runs the model.

One real OS thread loads the model, warms it up and then runs a continuous
batching loop. Requests reach it through an inbox (a deque producers only
append to); everything else is the engine thread's own. Each iteration spends
one chunk of at most ``CHAT_PREFILL_CHUNK`` prompt tokens, and about ``STALL``
decode steps' worth of time, on newcomers (all at once when nobody is decoding;
more when more wait to start than decode), then runs one decode step, so a long
prompt never stalls running streams for long. An idle engine lets requests sent
together land before it starts, so they share one prefill. Rows join and leave the
shared KV buffer in place; each row keeps its own sampling parameters and
random generator, so a seeded answer does not depend on who else is in the
batch. Finished conversations leave their KV in a bounded LRU so the next
turn only prefills what is new.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import logging
import time

import torch

from ..concurrency import Counter, Wakeup, run_in_thread, start_real_thread
from ..errors import EngineError, EngineUnavailable, Overloaded
from . import attention, prompt
from . import model as model_loader
from .base import Engine, GenParams, Generation
from .events import Delta, Done, Queued, Refused, Started
from .kv import KVBuffer, PrefixCache
from .prefill import PrefillJob
from .sampling import sample
from .slot import Slot

log = logging.getLogger(__name__)

STALL = 2.0  # a prefill chunk between two decode steps takes at most about this many decode steps
GATHER_S = 0.05  # the most an idle engine waits for requests being submitted along with the first


def _release_memory() -> None:
    """Hand freed heap back to the OS once the batch empties (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LocalEngine(Engine):
    """Runs the model on its own OS thread with continuous batching."""

    def __init__(self, settings):
        self.settings = settings
        self.model_name = settings.model_name or "loading"
        self.ready = False
        self.error = None
        self.loaded = None
        self.inbox: collections.deque = collections.deque()  # producers append, the engine pops
        self.waiting: collections.deque = collections.deque()  # engine thread only
        self.jobs: collections.deque = collections.deque()  # prefills in progress; engine thread only
        self.joining: collections.deque = collections.deque()  # (job, logits) prefilled, to join the batch
        self.rows: list[Slot] = []  # decoding; row i is row i of self.kv
        self.kv: KVBuffer | None = None
        self.prefix = PrefixCache(settings.kv_cache_mb * 1024 * 1024)
        self.wake = Wakeup()
        self.arriving = Counter()  # submits still fitting their prompt: see _gather
        self.accepting = True
        self.stopping = None  # reason, once shutdown was asked
        self.closed = False  # the engine thread has ended
        self.trimmed = True
        self.tokens_generated = 0
        self.prefilling = 0  # rows in self.jobs, kept by the engine thread for other threads to read
        self.step_s = 0.05  # measured: a decode step's forward (moving average)
        start_real_thread(self._run, name="engine")

    # ---- called from the web layer (any greenlet or thread) ----

    def submit(self, messages, params: GenParams, key=None) -> Generation:
        """Queue a generation; raises ``overloaded`` when the queue is full or stopping."""
        if not self.accepting or self.stopping:
            raise Overloaded("the server is shutting down")
        if self.error:
            raise EngineUnavailable("the model failed to load")
        # Only len() of the engine's structures: atomic, unlike iterating them.
        full = len(self.rows) + self.prefilling >= self.settings.max_batch
        if full and len(self.waiting) + len(self.inbox) >= self.settings.max_queue:
            raise Overloaded("the server is at capacity; try again shortly")
        gen = Generation(messages=messages, params=params, key=key)
        self.arriving.add(1)
        try:
            if self.ready:
                # Fit now, so a message too long for the context is refused instead of queued;
                # on a real thread, so a long history never holds up the event loop.
                gen.prompt_ids = run_in_thread(self._fit, gen)
            gen.on_cancel = lambda _g: self.wake.set()
            self.inbox.append(gen)
        finally:
            self.arriving.add(-1)  # before the wake-up, so a gathering engine sees it landed
            self.wake.set()
        if self.closed:  # lost the race with shutdown: nobody else will end it
            self._fail_inbox(self.stopping or "shutdown")
        return gen

    def stats(self) -> dict:
        return {"active": len(self.rows) + self.prefilling, "queued": len(self.waiting) + len(self.inbox),
                "prefix_cache_bytes": self.prefix.used, "prefix_hits": self.prefix.hits,
                "prefix_misses": self.prefix.misses, "tokens_generated": self.tokens_generated}

    def drain(self) -> None:
        """Stop taking new requests; running and queued ones go on."""
        self.accepting = False

    def shutdown(self, reason: str = "shutdown") -> None:
        self.accepting = False
        self.stopping = reason
        self.wake.set()

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # the server stays up to report it on /readyz
            log.exception("model load failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.closed = True
            self._fail_inbox("error")
            return
        with torch.inference_mode():  # every tensor the engine makes is an inference tensor
            self._loop()

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self._iterate()
            except Exception:
                # Leave the batch state alone (it may be half-updated): end every row as failed.
                log.exception("engine step failed")
                self._end_running("error")
        self._end_running(self.stopping)
        for gen in self.waiting:
            self._done(gen, self.stopping)
        self.waiting.clear()
        self.closed = True
        self._fail_inbox(self.stopping)

    def _iterate(self) -> None:
        """Take new requests, spend the prefill budget, run one decode step (or wait for work)."""
        self._take_inbox()
        if self.waiting and not self.rows and not self.jobs:
            self._gather()
        self._admit()
        self._prefill()
        if self.rows:
            self._step()
            self.trimmed = False
        # Prompts that finished prefilling join after the step: a long one's row makes every row's
        # attention longer, and the step of the running rows already waited for its last chunk.
        while self.joining:
            self._join(*self.joining.popleft())
            self._count()
        if not self.rows and not self.jobs:
            if not self.trimmed:
                _release_memory()
                self.trimmed = True
            self.wake.wait(1.0)

    def _gather(self) -> None:
        """Idle, with work to start: let requests submitted meanwhile (still fitting) land first.

        Users who send at the same moment are then prefilled in one forward, which costs far less
        than one after the other (8 prompts of 60 tokens: ~2.7x one, not 8x), so the last one's
        first token does not wait for the others' prefills. A lone request waits for nothing.
        """
        deadline = time.monotonic() + GATHER_S
        while self.arriving.value and not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.wake.wait(left)
            self._take_inbox()

    def _count(self) -> None:
        self.prefilling = sum(len(j.slots) for j in self.jobs) + sum(len(j.slots) for j, _ in self.joining)

    def _load(self) -> None:
        with torch.inference_mode():
            self.loaded = model_loader.load(self.settings)
            self.model_name = self.loaded.name
            attention.use(self.loaded.model)
            cfg = self.loaded.model.config.get_text_config(decoder=True)
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.dims = (cfg.num_hidden_layers, heads, head_dim, self.loaded.dtype, self.loaded.device)
            if self.settings.warmup:
                self._warmup()
        # Everything loaded so far lives for the whole process: keep it out of the GC's
        # full collections, which otherwise stall the event loop for tenths of a second.
        gc.collect()
        gc.freeze()
        self.ready = True
        log.info("engine ready: %s, max batch %d, prefill chunk %d", self.model_name,
                 self.settings.max_batch, self.settings.prefill_chunk)

    def _warmup(self) -> None:
        """Run a tiny generation, chunked and sampled, so the first user pays for no lazy initialisation."""
        started = time.monotonic()
        ids = prompt.render(self.loaded.tokenizer, [{"role": "user", "content": "Hi"}])
        job = PrefillJob([ids], self.dims)
        logits = job.step(self._forward, len(ids) // 2)
        logits = logits if logits is not None else job.step(self._forward, len(ids))
        params, generator = [GenParams(temperature=0.7, top_p=0.9)], [torch.Generator().manual_seed(0)]
        for i in range(3):
            token = sample(logits, params, generator)[0]
            logits = self._decode(job.kv, [token], [len(ids) + i])
        log.info("warm-up took %.2f s", time.monotonic() - started)

    def _forward(self, input_ids, kv: KVBuffer, position_ids, spans=None):
        """The next-token logits of every row after feeding ``input_ids`` (rows, columns)."""
        model = self.loaded.model
        out = model.get_decoder()(input_ids=input_ids, attention_mask=kv.attention_mask(input_ids.shape[1]),
                                  position_ids=position_ids, cache=kv.cache, use_cache=True, spans=spans)
        # The output head on a 2-D (rows, hidden) input. Given the model's own 3-D slice of a
        # multi-column forward, torch's matmul takes its batched path, which copies the whole
        # bf16 output matrix once per row when the weights are inference tensors (as they are
        # when loaded under gevent): 0.4 s of a 7-prompt prefill.
        return model.get_output_embeddings()(out.last_hidden_state[:, -1, :]).float()

    def _decode(self, kv: KVBuffer, tokens: list, positions: list):
        """One decode forward for every row of ``kv``: next-token logits."""
        device = self.loaded.device
        kv.reserve(1)
        kv.mask[:kv.n, kv.length] = 1
        spans = attention.plan(kv.row_starts(1), kv.length + 1 - kv.start) if kv.n > 1 else None
        logits = self._forward(torch.tensor(tokens, device=device)[:, None], kv,
                               torch.tensor(positions, device=device)[:, None], spans)
        kv.length += 1
        return logits

    def _fit(self, gen: Generation) -> list[int]:
        """The prompt ids, history trimmed so the answer has room in the context."""
        max_new = min(gen.params.max_new_tokens, self.settings.max_new_tokens)
        budget = self.settings.context_tokens - min(max_new, self.settings.context_tokens // 2)
        return prompt.fit(self.loaded.tokenizer, gen.messages, budget)[0]

    # ---- admission and prefill ----

    def _take_inbox(self) -> None:
        """Move new requests into the engine's own queue; drop waiters that were cancelled."""
        while True:
            try:
                self.waiting.append(self.inbox.popleft())
            except IndexError:
                break
        if any(g.cancel_reason for g in self.waiting):
            # One pass: a cancel landing between two scans would lose the generation.
            kept = collections.deque()
            for gen in self.waiting:
                reason = gen.cancel_reason
                if reason:
                    self._done(gen, reason)
                else:
                    kept.append(gen)
            self.waiting = kept

    def _admit(self) -> None:
        """Start prefilling waiters while the batch has room; tell the rest their position."""
        room = self.settings.max_batch - len(self.rows) - self.prefilling
        fresh = []
        while self.waiting and room > 0:
            gen = self.waiting.popleft()
            try:
                ids = gen.prompt_ids or self._fit(gen)
            except EngineError as exc:
                self._emit_error(gen, exc)
                continue
            room -= 1
            slot = Slot(gen, ids, self.loaded.tokenizer, self.settings)
            self._emit_start(slot)
            reused = self.prefix.take(gen.key, ids)
            if reused is None:
                fresh.append(slot)
                continue
            slot.reused = reused[2]
            self._add_job([slot], reused)
        if fresh:  # newcomers arriving together share their chunks
            self._add_job(fresh, None)
        for position, gen in enumerate(self.waiting, 1):
            if gen.position != position:
                gen.position = position
                self._emit_queued(gen, position)

    def _add_job(self, slots: list, reused) -> None:
        last = self.jobs[-1] if self.jobs else None
        if reused is None and last is not None and last.fresh and last.done == 0:
            # Fresh prompts still waiting for their first chunk: fewer, wider forwards.
            self.jobs.pop()
            slots = last.slots + slots
        job = PrefillJob([s.prompt_ids for s in slots], self.dims, reused)
        job.slots = slots
        self.jobs.append(job)
        self._count()

    def _prefill(self) -> None:
        """Spend this iteration's prompt budget, oldest job first; finished jobs wait in ``joining``."""
        # A chunk per decode step bounds the running rows' stall; when more users wait for their
        # first token than are decoding, they get proportionally more (the stall then hurts fewer).
        share = max(1, self.prefilling // max(1, len(self.rows)))
        budget = self.settings.prefill_chunk * share
        # The budget is also one of time: a chunk costs more the deeper its prompt (attention), so
        # its size follows the measured cost, to stall running rows at most ~STALL decode steps.
        target = STALL * self.step_s * share
        seconds = target
        while self.jobs and budget > 0 and seconds > 0:
            job = self.jobs[0]
            if all(s.gen.cancel_reason for s in job.slots):
                self.jobs.popleft()
                self._count()
                for slot in job.slots:
                    self._done(slot.gen, slot.gen.cancel_reason, slot)
                continue
            # Nobody decoding means nobody to stall: the whole prompt at once.
            columns = job.chunk(budget) if self.rows else job.remaining
            started = time.monotonic()
            logits = job.step(self._forward, columns)
            spent = time.monotonic() - started
            if self.rows:
                budget -= columns * job.rows
                seconds -= spent
                job.measured(columns, spent, self.step_s, target)
            if logits is not None:
                self.jobs.popleft()
                self.joining.append((job, logits))
            if self.rows and seconds < target / 2:
                break  # another forward now would stall the running rows past the target

    def _join(self, job: PrefillJob, logits) -> None:
        """Move a prefilled job's rows into the batch (in place) and sample their first tokens."""
        kept = []
        for r, slot in enumerate(job.slots):
            if slot.gen.cancel_reason:
                self._done(slot.gen, slot.gen.cancel_reason, slot)
            else:
                kept.append(r)
        if not kept:
            return
        if self.kv is None and len(kept) == job.rows:
            self.kv = job.kv  # the job's buffer becomes the batch's: no copy
        else:
            if self.kv is None:
                self.kv = KVBuffer(*self.dims, rows=len(kept), capacity=job.kv.length + 64)
            for r in kept:
                self.kv.add_row(*job.kv.row(r, copy=False))
        slots = [job.slots[r] for r in kept]
        self.rows += slots
        rows = logits[kept] if len(kept) < job.rows else logits
        self._accept_all(slots, rows)

    # ---- decoding ----

    def _step(self) -> None:
        """One decode step for every row in the batch."""
        now = time.monotonic()
        for slot in list(self.rows):
            if slot.gen.cancel_reason:
                self._finish(slot, slot.gen.cancel_reason)
            elif now >= slot.deadline:
                self._finish(slot, "timeout")
        if not self.rows:
            return
        started = time.monotonic()
        logits = self._decode(self.kv, [s.last for s in self.rows], [s.pos for s in self.rows])
        self.step_s += (time.monotonic() - started - self.step_s) / 8  # a moving average
        for slot in self.rows:
            slot.pos += 1
        self._accept_all(list(self.rows), logits)

    def _accept_all(self, slots: list, logits) -> None:
        """Sample every row's next token in one pass, then emit each row's text."""
        tokens = sample(logits, [s.params for s in slots], [s.generator for s in slots])
        for slot, token in zip(slots, tokens):
            self._accept(slot, token)

    def _accept(self, slot: Slot, token: int) -> None:
        """Take a row's next token and emit its text; finish the row if it ended."""
        text, reason = slot.take(token, self.loaded.eos_ids)
        if token not in self.loaded.eos_ids:
            self.tokens_generated += 1
        self._delta(slot, text)
        if reason:
            self._finish(slot, reason)

    def _finish(self, slot: Slot, reason: str) -> None:
        """End a row: flush its text, keep its KV for the next turn, emit ``done``."""
        if reason != "error":
            self._delta(slot, slot.flush())
        if slot in self.rows:
            r = self.rows.index(slot)
            if slot.gen.key and reason != "error":
                keys, values = self.kv.row(r)
                fed = slot.prompt_ids + slot.out_ids
                self.prefix.put(slot.gen.key, fed[:keys[0].shape[2]], keys, values)
            self._remove_row(r)
        self._done(slot.gen, reason, slot)

    def _remove_row(self, r: int) -> None:
        """The last row takes row ``r``'s place, in the list as in the buffer."""
        self.kv.remove_row(r)
        self.rows[r] = self.rows[-1]
        self.rows.pop()
        if not self.rows:
            self.kv = None

    def _end_running(self, reason: str) -> None:
        """End every decoding and prefilling row with ``reason`` (after a failure, touching no KV)."""
        jobs, self.jobs = self.jobs, collections.deque()
        jobs.extend(job for job, _ in self.joining)
        self.joining.clear()
        if reason == "error":
            rows, self.rows, self.kv = self.rows, [], None
            for slot in rows:
                self._done(slot.gen, reason, slot)
        while self.rows:
            self._finish(self.rows[-1], reason)
        for job in jobs:
            for slot in job.slots:
                self._done(slot.gen, reason, slot)
        self._count()

    def _fail_inbox(self, reason: str) -> None:
        while True:
            try:
                gen = self.inbox.popleft()
            except IndexError:
                return
            self._done(gen, reason)

    # ---- events: every emit goes through these ----

    def _emit_start(self, slot: Slot) -> None:
        slot.gen.emit(Started(len(slot.prompt_ids)))

    def _emit_queued(self, gen: Generation, position: int) -> None:
        gen.emit(Queued(position))

    def _emit_error(self, gen: Generation, exc: EngineError) -> None:
        gen.emit(Refused(exc.code, exc.message))

    def _delta(self, slot: Slot, text: str) -> None:
        if not text:
            return
        if slot.first_delta_at is None:
            slot.first_delta_at = time.monotonic()
        slot.gen.emit(Delta(text))

    def _done(self, gen: Generation, reason: str, slot: Slot | None = None) -> None:
        prompt_tokens, completion_tokens = (len(slot.prompt_ids), len(slot.out_ids)) if slot else (0, 0)
        gen.emit(Done.build(reason, prompt_tokens, completion_tokens, gen.submitted_at,
                            slot.first_delta_at if slot else None, slot.reused if slot else 0))
