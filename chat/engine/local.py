"""The inference engine: the only place that runs the model.

One real OS thread loads the model, warms it up and then runs a continuous
batching loop: each iteration the scheduler (``scheduler.py``) plans who starts,
who prefills how much and who is cut; the model runner (``runner.py``) runs
those prefill chunks and then one decode step for every row. Rows join and
leave the shared KV buffer in place; each row keeps its own sampling parameters
and random generator, so a seeded answer does not depend on who else is in the
batch. Finished conversations leave their KV in a bounded LRU so the next turn
only prefills what is new.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..concurrency import run_in_thread, start_real_thread
from ..config import Settings
from ..errors import EngineUnavailable, Overloaded
from . import cpu, drafts, grammar, kvdisk, prompt
from . import model as model_loader
from .base import Engine, GenParams, Generation
from .decoder import Decoder
from .events import Delta, Done, announce
from .kv import KVBuffer, PrefixCache, joined
from .prefill import PrefillJob
from .runner import ModelRunner, release_memory, runner_for
from .sampling import sample_rows
from .scheduler import Request, Scheduler
from .slot import Slot

log = logging.getLogger(__name__)
_DONE = object()  # the end of the idle chores


class LocalEngine(Engine):
    """Runs the model on its own OS thread with continuous batching."""

    loaded: model_loader.LoadedModel  # these three once loaded (``ready``)
    runner: ModelRunner
    grammars: grammar.Grammars

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model_name = settings.model_name or "loading"
        self.ready = False
        self.error: str | None = None
        self.rows: list[Slot] = []  # decoding; row i is row i of self.kv
        self.kv: KVBuffer | None = None
        self.prefix = PrefixCache(settings.kv_cache_mb * 1024 * 1024)
        self.queue = Scheduler(settings, self.prefix, self)
        self.accepting = True
        self.stopping: str | None = None  # reason, once shutdown was asked
        self.closed = False  # the engine thread has ended
        self.trimmed = True
        self.chores: Iterator[None] | None = None  # idle work after start-up (runner.chores): a step per idle turn
        self.tokens_generated = 0
        self.step_s = 0.05  # measured: a decode step's forward (moving average)
        self.drafter = drafts.Drafter(settings.draft != "off")
        start_real_thread(self._run, name="engine")

    # ---- called from the web layer (any greenlet or thread) ----

    def submit(self, messages: list, params: GenParams, key: str | None = None,
               owner: str | None = None) -> Generation:
        """Queue a generation; raises ``overloaded`` when the queue is full or stopping."""
        if not self.accepting or self.stopping:
            raise Overloaded("the server is shutting down")
        if self.error:
            raise EngineUnavailable("the model failed to load")
        queue = self.queue
        # Only len() of the engine's structures: atomic, unlike iterating them.
        full = len(self.rows) + queue.prefilling >= self.settings.max_batch
        if full and queue.queued() >= self.settings.max_queue:
            raise Overloaded("the server is at capacity; try again shortly")
        gen = Generation(messages=messages, params=params, key=key, owner=owner, notify=self._notify)
        request = Request(gen)
        queue.arriving.add(1)
        try:
            if self.ready:
                # Fit now, so a message too long for the context is refused instead of queued;
                # on a real thread, so a long history never holds up the event loop.
                request.prompt_ids, request.matcher = run_in_thread(self.prepare, gen)
            queue.put(request)
        finally:
            queue.arriving.add(-1)  # before the wake-up, so a gathering engine sees it landed
            queue.wake.set()
        if self.closed:  # lost the race with shutdown: nobody else will end it
            self._fail_inbox(self.stopping or "shutdown")
        return gen

    def _notify(self, _gen: Generation) -> None:
        """A generation was cancelled: the engine ends it at its next iteration."""
        self.queue.wake.set()

    def stats(self) -> dict:
        return {"active": len(self.rows) + self.queue.prefilling, "queued": self.queue.queued(),
                "prefix_cache_bytes": self.prefix.used, "prefix_hits": self.prefix.hits,
                "prefix_misses": self.prefix.misses, "prefix_shared_hits": self.prefix.shared_hits,
                "tokens_generated": self.tokens_generated, **self.drafter.stats(),
                "finishing": self.chores is not None,
                "decode": "native" if self.ready and self.runner.native else "torch"}

    def drain(self) -> None:
        """Stop taking new requests; running and queued ones go on."""
        self.accepting = False

    def shutdown(self, reason: str = "shutdown") -> None:
        self.accepting = False
        self.stopping = reason
        self.queue.wake.set()

    @property
    def decoder(self) -> Decoder | None:
        """The own decoder the runner runs, or None on transformers' forward."""
        return self.runner.decoder

    @property
    def dims(self) -> tuple:
        """A KV buffer's (layers, heads, head dim, dtype, device) for this model (the scheduler's jobs)."""
        return self.runner.dims

    @property
    def wide_prefill(self) -> bool:
        return self.runner.wide_prefill

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
        self.prefix.flush()  # the KV of answers the shutdown ended, on disk for the next start
        for request in self.queue.waiting:
            self.done(request.gen, self.stopping)
        self.queue.waiting.clear()
        self.closed = True
        self._fail_inbox(self.stopping)

    def _iterate(self) -> None:
        """Carry out the scheduler's plan: its admissions, its prefill chunks, one decode step (or wait for work)."""
        queue = self.queue
        self.prefix.tidy()  # deleted conversations' entries out
        plan = queue.plan(self.rows, self.step_s, lambda: self.stopping)
        announce(plan, self.done)
        while (chunk := queue.chunk(plan)) is not None:
            started = time.monotonic()
            logits = self.runner.prefill(chunk.job, chunk.columns)
            queue.ran(plan, chunk, time.monotonic() - started, logits)
        announce(plan, self.done)  # prefills whose every prompt was cancelled
        if self.rows:
            self._step()
            self.trimmed = False
        # Prompts that finished prefilling join after the step: a long one's row makes every row's
        # attention longer, and the step of the running rows already waited for its last chunk.
        for job, logits in queue.take_joining():
            self._join(job, logits)
        if not queue.busy(self.rows):
            if self.prefix.disk is not None:
                self.prefix.disk.idle.set()  # its writes wait for a moment like this
            if self.prefix.wanted and not queue.queued():
                self._warm(list(self.prefix.wanted.popitem()[0]))
                return
            if self.chores is not None and not queue.waiting:
                if next(self.chores, _DONE) is _DONE:
                    self.chores = None
                    self.weights, self.formats = self.runner.weights, self.runner.formats()  # the chores may move them
                return  # one step of idle work at a time, then look for requests again
            if not self.trimmed:
                release_memory()
                self.trimmed = True
            queue.wake.wait(1.0)

    def _load(self) -> None:
        with torch.inference_mode():
            self.loaded = model_loader.load(self.settings)
            self.model_name = self.loaded.name
            runner = self.runner = runner_for(self.loaded)
            if self.settings.warmup:
                runner.warm_up()
            self.weights, self.formats = runner.weights, runner.formats()
            self.cpu = cpu.detect(self.settings.cpu_isa).isa
            self.vocab_size = runner.vocab_size
            self.grammars = grammar.Grammars(self.loaded.tokenizer, self.loaded.eos_ids, runner.vocab_size)
            self.chores = runner.chores(self.settings)
            settings = self.settings
            if settings.kv_disk_mb > 0 and settings.kv_cache_mb > 0:  # conversations' KV on disk too
                self.prefix.disk = kvdisk.for_model(
                    Path(settings.model_cache_dir) / "kv", settings.kv_disk_mb * 1024 * 1024, self.loaded.name,
                    self.loaded.source or settings.model, runner.dims, settings.quant, self.cpu,
                    busy=lambda: bool(self.rows or self.queue.jobs))
            # the default system prompt's preamble first, so the first user after a start reuses it too
            system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
            self.prefix.want(prompt.preamble(self.loaded.tokenizer, system))
        # Everything loaded so far lives for the whole process: keep it out of the GC's
        # full collections, which otherwise stall the event loop for tenths of a second.
        gc.collect()
        gc.freeze()
        release_memory()  # loading's temporaries (a GGUF's unpacked blocks: hundreds of MB)
        self.ready = True
        log.info("engine ready: %s, max batch %d, prefill chunk %d", self.model_name,
                 self.settings.max_batch, self.settings.prefill_chunk)

    def forget(self, key: str) -> None:
        self.prefix.forget(key)
        self.queue.wake.set()

    def fit(self, gen: Generation) -> list[int]:
        """The prompt ids, history trimmed so the answer has room in the context."""
        settings, params = self.settings, gen.params
        ids = prompt.request_ids(self.loaded.tokenizer, gen.messages, params, settings.context_tokens,
                                 settings.max_new_tokens)
        if not params.tools and not params.raw_prompt:
            self.prefix.want(prompt.preamble(self.loaded.tokenizer, gen.messages))
        return ids

    def _warm(self, ids: list[int]) -> None:
        """Prefill a preamble alone (as every prompt that reuses it would see it) and share its KV."""
        if self.prefix.has_preamble(ids):
            return
        job = PrefillJob([ids], self.dims)
        self.runner.prefill(job, len(ids))
        self.prefix.share(ids, *job.kv.row(0, copy=True))

    def prepare(self, gen: Generation) -> tuple[list[int], object]:
        """(prompt ids, the grammar's matcher or None): on the submitting request's thread."""
        ids = self.fit(gen)
        self.prefix.fetch(gen.key)  # a conversation's KV from disk, when memory holds none (after a restart)
        params = gen.params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.grammars.tokenizer  # noqa: B018 (built on first use, here rather than on the engine thread)
        if params.grammar:
            self.grammars.table  # noqa: B018 (likewise)
        return ids, self.grammars.matcher(params.grammar) if params.grammar else None

    def new_slot(self, gen: Generation, ids: list, matcher: object = None) -> Slot:
        """A request's slot as it starts (the scheduler's admission)."""
        slot = Slot(gen, ids, self.loaded.tokenizer, self.settings)
        slot.constrain(matcher, self.grammars)
        return slot

    # ---- joining and decoding ----

    def _join(self, job: PrefillJob, logits: torch.Tensor) -> None:
        """Move a prefilled job's rows into the batch (in place) and sample their first tokens."""
        kept = []
        for r, slot in enumerate(job.slots):
            if slot.gen.cancel_reason:
                self.done(slot.gen, slot.gen.cancel_reason, slot)
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

    def _step(self) -> None:
        """One decode step for every row in the batch, once the rows the scheduler cuts have ended."""
        for slot, reason in self.queue.cut(self.rows):
            self._finish(slot, reason)
        if not self.rows:
            return
        assert self.kv is not None
        if len(self.rows) == 1 and self.drafter.step(self.rows[0], self.kv, self.runner, self._take):
            return
        started = time.monotonic()
        logits = self.runner.decode(self.kv, [s.last for s in self.rows], [s.pos for s in self.rows])
        spent = time.monotonic() - started
        self.step_s += (spent - self.step_s) / 8  # a moving average
        if len(self.rows) == 1:
            self.drafter.costs.measured(1, spent)
        for slot in self.rows:
            slot.pos += 1
        self._accept_all(list(self.rows), logits)

    def _take(self, slot: Slot, token: int | str) -> bool:
        """``slot``'s next token, or why sampling failed (the row ends with ``error``); whether the row goes on."""
        if isinstance(token, str):
            self._finish(slot, "error", token)
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
                    self._finish(s, "length")
            slots, logits = [slots[j] for j in keep], logits[keep]
            if not slots:
                return
        scores = grammar.log_probs(logits, slots)
        failed = grammar.apply_masks(logits, slots)
        tokens = grammar.settle(slots, sample_rows(logits, [s.params for s in slots], [s.generator for s in slots],
                                                   native=self.runner.sampler()))
        for j, (slot, token) in enumerate(zip(slots, tokens)):
            if scores is not None and j in scores and not isinstance(token, str) and token not in self.loaded.eos_ids:
                slot.pending.append(grammar.entry(self.grammars, scores[j], token, slot.params.logprobs or 0))
            self._take(slot, token)
        for slot in failed:
            if slot in self.rows:
                log.warning("grammar failed: %s", slot.matcher.get_error())
                self._finish(slot, "stop")

    def _accept(self, slot: Slot, token: int) -> None:
        """Take a row's next token and emit its text; finish the row if it ended."""
        text, reason = slot.take(token, self.loaded.eos_ids)
        if token not in self.loaded.eos_ids:
            self.tokens_generated += 1
        self._delta(slot, text)
        if reason:
            self._finish(slot, reason)

    def _finish(self, slot: Slot, reason: str, message: str | None = None) -> None:
        """End a row: flush its text, keep its KV for the next turn, emit ``done``."""
        if reason != "error":
            self._delta(slot, slot.flush(), last=True)
        if slot in self.rows:
            assert self.kv is not None
            r = self.rows.index(slot)
            if slot.gen.key and reason != "error":
                keys, values = self.kv.row(r)
                fed = slot.prompt_ids + slot.out_ids
                self.prefix.put(slot.gen.key, fed[:keys[0].shape[2]], keys, values)
            self._remove_row(r)
        self.done(slot.gen, reason, slot, message)

    def _remove_row(self, r: int) -> None:
        """The last row takes row ``r``'s place, in the list as in the buffer."""
        assert self.kv is not None
        self.kv.remove_row(r)
        self.rows[r] = self.rows[-1]
        self.rows.pop()
        if not self.rows:
            self.kv = None

    def _end_running(self, reason: str) -> None:
        """End every decoding and prefilling row with ``reason`` (after a failure, touching no KV)."""
        jobs = self.queue.take_all()
        if reason == "error":
            rows, self.rows, self.kv = self.rows, [], None
            for slot in rows:
                self.done(slot.gen, reason, slot)
        while self.rows:
            self._finish(self.rows[-1], reason)
        for job in jobs:
            for slot in job.slots:
                self.done(slot.gen, reason, slot)

    def _fail_inbox(self, reason: str) -> None:
        for request in self.queue.drain_inbox():
            self.done(request.gen, reason)

    # ---- events: every emit goes through these ----

    def _delta(self, slot: Slot, text: str, last: bool = False) -> None:
        event = slot.delta(text, last)
        if event is not None:
            slot.gen.emit(event)

    def done(self, gen: Generation, reason: str, slot: Slot | None = None, message: str | None = None) -> None:
        gen.emit(slot.done(reason, message) if slot else Done.build(reason, 0, 0, gen.submitted_at, None, 0, message,
                                                                   message))
