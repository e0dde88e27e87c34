"""The local engine: the interface the web calls (``submit``, ``stats``, ``describe``...), the model's load, and
its one OS thread's loop.

Each iteration the scheduler (``scheduler.py``) makes one plan: who ends, starts or waits, who prefills how
much, who is cut, who decodes and who drafts; the loop carries it out: the model runner (``model/runner.py``)
runs the prefill chunks, and the batch (``batch.py``) runs the decode step, samples and ends rows. A prompt is
prepared (template, ids, grammar) before the scheduler sees it: in ``submit``, on the submitting request's
thread, or, while the model loads, once it is in. Idle, the loop warms shared preambles and runs the runner's
chores a step at a time.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ...concurrency import real_lock, run_in_thread, start_real_thread
from ...config import Settings
from ...errors import EngineError, EngineUnavailable, Overloaded
from ..base import Engine, Generation, GenParams
from ..events import Refused, announce, thinks
from ..kernels import cpu
from ..kv import disk as kvdisk
from ..kv.prefix import PrefixCache
from ..model import loader as model_loader
from ..model.decoder import Decoder
from ..model.prefill import PrefillJob
from ..model.runner import ModelRunner, release_memory, runner_for
from . import drafts, grammar, prompt
from .batch import Batch, done
from .scheduler import Request, Scheduler

log = logging.getLogger(__name__)
_DONE = object()  # the end of the idle chores


class LocalEngine(Engine):
    """Runs the model on its own OS thread with continuous batching."""

    loaded: model_loader.LoadedModel  # these three once loaded (``ready``)
    runner: ModelRunner
    grammars: grammar.Grammars

    weights: str  # what the decode step multiplies by (``describe``), once loaded
    formats: dict[str, str] | None
    cpu: str

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model_name = settings.model_name or "loading"
        self.ready = False
        self.error: str | None = None
        self.prefix = PrefixCache(settings.kv_cache_mb * 1024 * 1024, share_all=settings.shared_prefix == "all")
        self.queue = Scheduler(settings, self.prefix)
        # Generations submitted while the model loads: prepared on the engine thread once it is in.
        self.early: list[Generation] = []
        self.early_lock = real_lock()
        self.accepting = True
        self.stopping: str | None = None  # reason, once shutdown was asked
        self.closed = False  # the engine thread has ended
        self.trimmed = True
        self.step_s = 0.0  # the warm-up's decode step (seconds), for the start-up line
        self.chores: Iterator[None] | None = None  # idle work after start-up (runner.chores): a step per idle turn
        self.batch = Batch(self.prefix, drafts.Drafter(settings.draft != "off"))  # the decoding rows
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
        full = len(self.batch.rows) + queue.prefilling >= self.settings.max_batch
        if full and self.queued() >= self.settings.max_queue:
            raise Overloaded("the server is at capacity; try again shortly")
        gen = Generation(messages=messages, params=params, key=key, owner=owner, notify=self._notify)
        queue.arriving.add(1)
        try:
            with self.early_lock:
                early = not self.ready
                if early:
                    self.early.append(gen)
            if not early:
                # Fit now, so a message too long for the context is refused instead of queued;
                # on a real thread, so a long history never holds up the event loop.
                queue.put(Request(gen, *run_in_thread(self.prepare, gen)))
        finally:
            queue.arriving.add(-1)  # before the wake-up, so a gathering engine sees it landed
            queue.wake.set()
        if self.closed:  # lost the race with shutdown: nobody else will end it
            self._fail_inbox(self.stopping or "shutdown")
        return gen

    def queued(self) -> int:
        """Generations waiting to start (len() only: atomic, unlike iterating)."""
        return self.queue.queued() + len(self.early)

    def _notify(self, _gen: Generation) -> None:
        """A generation was cancelled: the engine ends it at its next iteration."""
        self.queue.wake.set()

    def stats(self) -> dict:
        batch = self.batch
        return {"active": len(batch.rows) + self.queue.prefilling, "queued": self.queued(),
                "prefix_cache_bytes": self.prefix.used, "prefix_hits": self.prefix.hits,
                "prefix_misses": self.prefix.misses, "prefix_shared_hits": self.prefix.shared_hits,
                "tokens_generated": batch.tokens_generated, **batch.drafter.stats(),
                "finishing": self.chores is not None,
                "decode": "native" if self.ready and self.runner.native else "torch"}

    def describe(self) -> dict:
        """The loaded model's facts: what its decode step multiplies by (the idle chores may move it: ``formats``
        per class of product), on which CPU class, in C++ or torch, whether idle chores are still under way
        (crossovers, the C++ build) and the drafts' counts."""
        if not self.ready:
            return {}
        stats = self.stats()
        template = self.loaded.template
        facts = {"weights": self.weights, "cpu": self.cpu, "finishing": stats["finishing"], "decode": stats["decode"],
                 "template": template.name, "base_model": template.base_model, "thinking": self.thinks(),
                 **self.batch.drafter.stats()}
        if self.formats:
            facts["formats"] = self.formats
        return facts

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
        with self.early_lock:
            self.ready = True
            early, self.early = self.early, []
        log.info("engine ready: %s", self._ready_line())
        self._prepare_early(early)
        with torch.inference_mode():  # every tensor the engine makes is an inference tensor
            self._loop()

    def _ready_line(self) -> str:
        """The start-up line: the model, which path runs it, the warm-up's measured speed, the batch's limits."""
        own = self.runner.decoder is not None
        path = ("the own decoder" if own else
                "transformers' forward (an architecture the own decoder does not run: slower, see docs/models.md)")
        speed = ""
        if self.step_s:
            later = " until the C++ step is in" if own and self.chores is not None else ""
            speed = f", a decode step {self.step_s * 1000:.0f} ms (~{1 / self.step_s:.0f} tokens/s one answer{later})"
        return (f"{self.model_name} on {path}{speed}, max batch {self.settings.max_batch}, "
                f"prefill chunk {self.settings.prefill_chunk}")

    def _prepare_early(self, early: list[Generation]) -> None:
        """Fit the generations submitted while the model loaded (refusing those that do not fit) and queue them
        ahead of any submitted since."""
        requests = []
        for gen in early:
            try:
                requests.append(Request(gen, *self.prepare(gen)))
            except EngineError as exc:
                gen.emit(Refused(exc.code, exc.message))
        self.queue.inbox.extendleft(reversed(requests))
        self.queue.wake.set()

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
            done(request.gen, self.stopping)
        self.queue.waiting.clear()
        self.closed = True
        self._fail_inbox(self.stopping)

    def _iterate(self) -> None:
        """Carry out the scheduler's plan for this iteration: its events, its prefill chunks, the decode step
        (cut rows, drafts, every row's next token), the prefilled rows joining; or idle work, or wait."""
        queue = self.queue
        self.prefix.tidy()  # deleted conversations' entries out
        batch = self.batch
        plan = queue.plan(batch.rows, batch.step_s, lambda: self.stopping)
        announce(plan, done)
        for chunk in queue.chunks(plan):
            started = time.monotonic()
            self.runner.prefill(chunk.job, chunk.columns)
            chunk.spent = time.monotonic() - started
        announce(plan, done)  # prefills whose every prompt was cancelled
        if batch.rows:
            batch.step(plan)
            self.trimmed = False
        # Prompts that finished prefilling join after the step: a long one's row makes every row's
        # attention longer, and the step of the running rows already waited for its last chunk.
        for job in queue.take_joining():
            batch.join(job)
        if not queue.busy(batch.rows):
            if self.prefix.disk is not None:
                self.prefix.disk.idle.set()  # its writes wait for a moment like this
            if self.prefix.wanted and not queue.queued() and not queue.arriving.value:
                # (not while a submit fits its prompt: its first token would wait for this forward)
                self._warm(*self.prefix.wanted.popitem()[0])
                return
            if self.chores is not None and not queue.waiting:
                if next(self.chores, _DONE) is _DONE:
                    self.chores = None
                    # the chores may move the weights (onto the block products, once built)
                    self.weights, self.formats = self.runner.weights, self.runner.formats()
                    self.queue.wide_prefill = self.runner.wide_prefill
                return  # one step of idle work at a time, then look for requests again
            if not self.trimmed:
                release_memory()
                self.trimmed = True
            queue.wake.wait(1.0)

    def _load(self) -> None:
        with torch.inference_mode():
            self.loaded = model_loader.load(self.settings, self._loading)
            self.model_name = self.loaded.name
            runner = self.runner = runner_for(self.loaded)
            if self.settings.warmup:
                hi = prompt.render(self.loaded.tokenizer, [{"role": "user", "content": "Hi"}])
                self.step_s = runner.warm_up(hi)
            self.weights, self.formats = runner.weights, runner.formats()
            self.cpu = cpu.detect(self.settings.cpu_isa).isa
            self.vocab_size = runner.vocab_size
            self.grammars = grammar.Grammars(self.loaded.tokenizer, self.loaded.eos_ids, runner.vocab_size)
            self.queue.loaded(runner.dims, self.loaded.tokenizer, runner.wide_prefill, self.loaded.template.stops,
                              self.grammars)
            self.batch.loaded(runner, self.grammars, self.loaded.eos_ids)
            self.chores = itertools.chain(runner.chores(self.settings), self.batch.drafter.checks(runner))
            settings = self.settings
            if settings.kv_disk_mb > 0 and settings.kv_cache_mb > 0:  # conversations' KV on disk too
                # scaled rotary positions key it too (Phi-3's LongRoPE factors follow CHAT_CONTEXT_TOKENS)
                factors = self.decoder.shape.rope_factors if self.decoder is not None else None
                self.prefix.disk = kvdisk.for_model(
                    Path(settings.model_cache_dir) / "kv", settings.kv_disk_mb * 1024 * 1024, self.loaded.name,
                    self.loaded.source or settings.model, runner.dims, settings.quant, self.cpu,
                    *((factors,) if factors else ()), busy=lambda: bool(self.batch.rows or self.queue.jobs))
            # the default system prompt's preamble first, so the first user after a start reuses it too
            system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
            self.prefix.want(prompt.preamble(self.loaded.tokenizer, system))
        # Everything loaded so far lives for the whole process: keep it out of the GC's
        # full collections, which otherwise stall the event loop for tenths of a second.
        gc.collect()
        gc.freeze()
        release_memory()  # loading's temporaries (a GGUF's unpacked blocks: hundreds of MB)
        self.loading = None  # the conversion's progress: said while loading only

    def _loading(self, step: str, done: int, total: int) -> None:
        """How far a long step of the load is (a GGUF's conversion), for ``/readyz``."""
        self.loading = {"step": step, "done": done, "total": total}

    def thinks(self) -> bool:
        """Whether the loaded model thinks (its template writes ``<think>``)."""
        return self.ready and thinks(getattr(self.loaded.tokenizer, "chat_template", None))

    def count_tokens(self, text: str) -> int | None:
        if not self.ready:
            return None
        return len(self.loaded.tokenizer.encode(text, add_special_tokens=False))

    def forget(self, key: str) -> None:
        self.prefix.forget(key)
        self.queue.wake.set()

    def fit(self, gen: Generation) -> list[int]:
        """The prompt ids, history trimmed so the answer has room in the context."""
        settings, params = self.settings, gen.params
        ids = prompt.request_ids(self.loaded.tokenizer, gen.messages, params, settings.context_tokens,
                                 settings.max_new_tokens)
        if not params.tools and not params.raw_prompt:
            salt = prompt.preamble_salt(gen.messages, settings.system_prompt, params.cache_salt)
            self.prefix.want(prompt.preamble(self.loaded.tokenizer, gen.messages), salt)
        return ids

    def _warm(self, ids: tuple | list[int], salt: str | None = None) -> None:
        """Prefill a preamble alone (as every prompt that reuses it would see it) and share its KV with the
        prompts of ``salt`` (None: everyone's)."""
        if self.prefix.has_preamble(ids, salt):
            return
        job = PrefillJob([list(ids)], self.runner.dims)
        self.runner.prefill(job, len(ids))
        self.prefix.share(ids, *job.kv.row(0, copy=True), salt=salt)

    def prepare(self, gen: Generation) -> tuple[list[int], object]:
        """(prompt ids, the grammar's matcher or None): on the submitting request's thread."""
        ids = self.fit(gen)
        self.prefix.fetch(gen.key, gen.params.cache_salt)  # its KV from disk, when memory holds none (a restart)
        params = gen.params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.grammars.tokenizer  # noqa: B018 (built on first use, here rather than on the engine thread)
        if params.grammar:
            self.grammars.table  # noqa: B018 (likewise)
        return ids, self.grammars.matcher(params.grammar) if params.grammar else None

    def _end_running(self, reason: str) -> None:
        """End every decoding and prefilling row with ``reason`` (after a failure, touching no KV)."""
        jobs = self.queue.take_all()
        self.batch.end(reason)
        for job in jobs:
            for slot in job.slots:
                done(slot.gen, reason, slot)

    def _fail_inbox(self, reason: str) -> None:
        with self.early_lock:
            early, self.early = self.early, []
        for gen in early:
            done(gen, reason)
        for request in self.queue.drain_inbox():
            done(request.gen, reason)
