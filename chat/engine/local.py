"""The inference engine: the only place that runs the model.

One real OS thread loads the model, warms it up and then runs a continuous
batching loop: the scheduler (``scheduler.py``) takes new requests and spends
the iteration's prefill budget, then one decode step runs for every row. Rows
join and leave the shared KV buffer in place; each row keeps its own sampling
parameters and random generator, so a seeded answer does not depend on who
else is in the batch. Finished conversations leave their KV in a bounded LRU
so the next turn only prefills what is new.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import time

import torch

from ..concurrency import run_in_thread, start_real_thread
from ..errors import EngineError, EngineUnavailable, Overloaded, PromptTooLong
from . import attention, cpu, grammar, native, prompt
from . import model as model_loader
from .base import Engine, GenParams, Generation
from .events import Delta, Done, Queued, Refused, Started
from .kv import KVBuffer, PrefixCache
from .prefill import PrefillJob
from .sampling import sample
from .scheduler import Request, Scheduler
from .slot import Slot

log = logging.getLogger(__name__)
_DONE = object()  # the end of the idle chores


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
        self.decoder = None  # the own forward (decoder.py), or None for transformers'
        self.rows: list[Slot] = []  # decoding; row i is row i of self.kv
        self.kv: KVBuffer | None = None
        self.prefix = PrefixCache(settings.kv_cache_mb * 1024 * 1024)
        self.queue = Scheduler(self)
        self.accepting = True
        self.stopping = None  # reason, once shutdown was asked
        self.closed = False  # the engine thread has ended
        self.trimmed = True
        self.chores = None  # idle work after start-up (model.finish): an iterator, a step per idle turn
        # System prompts' preambles seen without their KV held, as keys (any thread adds: atomic; the engine
        # pops them with popitem, prefills each alone while idle and shares it: PrefixCache.share)
        self.preambles: dict[tuple, None] = {}
        self.tokens_generated = 0
        self.step_s = 0.05  # measured: a decode step's forward (moving average)
        start_real_thread(self._run, name="engine")

    # ---- called from the web layer (any greenlet or thread) ----

    def submit(self, messages, params: GenParams, key=None, owner=None) -> Generation:
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
                "tokens_generated": self.tokens_generated,
                "finishing": self.chores is not None,
                "decode": "native" if self._native else "torch"}

    def drain(self) -> None:
        """Stop taking new requests; running and queued ones go on."""
        self.accepting = False

    def shutdown(self, reason: str = "shutdown") -> None:
        self.accepting = False
        self.stopping = reason
        self.queue.wake.set()

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
        for request in self.queue.waiting:
            self.done(request.gen, self.stopping)
        self.queue.waiting.clear()
        self.closed = True
        self._fail_inbox(self.stopping)

    def _iterate(self) -> None:
        """Take new requests, spend the prefill budget, run one decode step (or wait for work)."""
        queue = self.queue
        queue.take_inbox()
        if queue.waiting and not queue.busy:
            queue.gather()
        queue.admit()
        queue.prefill()
        if self.rows:
            self._step()
            self.trimmed = False
        # Prompts that finished prefilling join after the step: a long one's row makes every row's
        # attention longer, and the step of the running rows already waited for its last chunk.
        for job, logits in queue.take_joining():
            self._join(job, logits)
        if not queue.busy:
            if self.preambles and not queue.queued():
                self._warm(list(self.preambles.popitem()[0]))
                return
            if self.chores is not None and not queue.waiting:
                if next(self.chores, _DONE) is _DONE:
                    self.chores = None
                    if self.loaded.decoder is not None:  # the chores may have moved the weights (block products)
                        self.weights, self.formats = self.loaded.weights, self.loaded.decoder.formats()
                return  # one step of idle work at a time, then look for requests again
            if not self.trimmed:
                _release_memory()
                self.trimmed = True
            queue.wake.wait(1.0)

    def _load(self) -> None:
        with torch.inference_mode():
            self.loaded = model_loader.load(self.settings)
            self.model_name = self.loaded.name
            decoder = self.decoder = self.loaded.decoder
            if decoder is not None:
                s = decoder.shape
                self.dims = (s.layers, s.kv_heads, s.head_dim, self.loaded.dtype, self.loaded.device)
            else:
                attention.use(self.loaded.model)
                cfg = self.loaded.model.config.get_text_config(decoder=True)
                heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
                head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                self.dims = (cfg.num_hidden_layers, heads, head_dim, self.loaded.dtype, self.loaded.device)
            if self.settings.warmup:
                self._warmup()
            self.weights = self.loaded.weights
            self.cpu = cpu.detect(self.settings.cpu_isa).isa
            self.formats = decoder.formats() if decoder is not None else None
            self.vocab_size = (decoder.shape.vocab if decoder is not None
                               else self.loaded.model.get_output_embeddings().weight.shape[0])
            self.grammars = grammar.Grammars(self.loaded.tokenizer, self.loaded.eos_ids, self.vocab_size)
            self.chores = model_loader.finish(self.loaded, self.settings)
            # the default system prompt's preamble first, so the first user after a start reuses it too
            self._want_preamble([{"role": "system", "content": self.settings.system_prompt}]
                                if self.settings.system_prompt else [])
        # Everything loaded so far lives for the whole process: keep it out of the GC's
        # full collections, which otherwise stall the event loop for tenths of a second.
        gc.collect()
        gc.freeze()
        _release_memory()  # loading's temporaries (a GGUF's unpacked blocks: hundreds of MB)
        self.ready = True
        log.info("engine ready: %s, max batch %d, prefill chunk %d", self.model_name,
                 self.settings.max_batch, self.settings.prefill_chunk)

    def _warmup(self) -> None:
        """Run a tiny generation, chunked and sampled, so the first user pays for no lazy initialisation."""
        started = time.monotonic()
        ids = prompt.render(self.loaded.tokenizer, [{"role": "user", "content": "Hi"}])
        job = PrefillJob([ids], self.dims)
        logits = job.step(self.forward, len(ids) // 2)
        logits = logits if logits is not None else job.step(self.forward, len(ids))
        params, generator = [GenParams(temperature=0.7, top_p=0.9)], [torch.Generator().manual_seed(0)]
        for i in range(3):
            token = sample(logits, params, generator)[0]
            logits = self._decode(job.kv, [token], [len(ids) + i])
        log.info("warm-up took %.2f s", time.monotonic() - started)

    def forward(self, input_ids, kv: KVBuffer, position_ids, spans=None, every: bool = False):
        """The next-token logits of every row after feeding ``input_ids`` (rows, columns); ``every``:
        of every column (rows, columns, vocab)."""
        if self.decoder is not None:
            return self.decoder(input_ids, kv, position_ids, spans, every=every)
        model = self.loaded.model
        out = model.get_decoder()(input_ids=input_ids, attention_mask=kv.attention_mask(input_ids.shape[1]),
                                  position_ids=position_ids, cache=kv.cache, use_cache=True, spans=spans)
        # The output head on a 2-D (rows, hidden) input. Given the model's own 3-D slice of a
        # multi-column forward, torch's matmul takes its batched path, which copies the whole
        # bf16 output matrix once per row when the weights are inference tensors (as they are
        # when loaded under gevent): 0.4 s of a 7-prompt prefill.
        if every:
            rows, cols = input_ids.shape
            return model.get_output_embeddings()(out.last_hidden_state.reshape(rows * cols, -1)).float().view(
                rows, cols, -1)
        return model.get_output_embeddings()(out.last_hidden_state[:, -1, :]).float()

    def _decode(self, kv: KVBuffer, tokens: list, positions: list):
        """One decode forward for every row of ``kv``: next-token logits."""
        device = self.loaded.device
        kv.reserve(1)
        kv.mask[:kv.n, kv.length] = 1
        # the torch step's runs of rows (the C++ step takes each row's own columns itself)
        spans = attention.plan(kv.row_starts(1), kv.length + 1 - kv.start) if kv.n > 1 and not self._native else None
        logits = self.forward(torch.tensor(tokens, device=device)[:, None], kv,
                               torch.tensor(positions, device=device)[:, None], spans)
        kv.length += 1
        return logits

    def fit(self, gen: Generation) -> list[int]:
        """The prompt ids, history trimmed so the answer has room in the context."""
        max_new = min(gen.params.max_new_tokens, self.settings.max_new_tokens)
        budget = self.settings.context_tokens - min(max_new, self.settings.context_tokens // 2)
        if gen.params.raw_prompt:
            ids = self.loaded.tokenizer.encode(gen.messages[-1]["content"])
            if len(ids) > budget:
                raise PromptTooLong(f"the prompt does not fit in the model's context of {budget} tokens")
            return ids
        ids = prompt.fit(self.loaded.tokenizer, gen.messages, budget, gen.params.tools)[0]
        if not gen.params.tools:
            self._want_preamble(gen.messages)
        return ids

    def _want_preamble(self, messages: list) -> None:
        """Note ``messages``' system prompt's preamble for idle prefilling unless its KV is held (any thread)."""
        ids = tuple(prompt.preamble(self.loaded.tokenizer, messages))
        if len(ids) >= 4 and len(self.preambles) < 16 and not self.prefix.has_preamble(ids):
            self.preambles[ids] = None

    def _warm(self, ids: list[int]) -> None:
        """Prefill a preamble alone (as every prompt that reuses it would see it) and share its KV."""
        if self.prefix.has_preamble(ids):
            return
        job = PrefillJob([ids], self.dims)
        job.step(self.forward, len(ids))
        self.prefix.share(ids, *job.kv.row(0, copy=True))

    def prepare(self, gen: Generation) -> tuple[list[int], object]:
        """(prompt ids, the grammar's matcher or None): on the submitting request's thread."""
        ids = self.fit(gen)
        params = gen.params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.grammars.tokenizer  # noqa: B018 (built on first use, here rather than on the engine thread)
        return ids, self.grammars.matcher(params.grammar) if params.grammar else None

    def new_slot(self, gen: Generation, ids: list, matcher=None) -> Slot:
        """A request starts: its slot, and ``Started`` to its consumer."""
        slot = Slot(gen, ids, self.loaded.tokenizer, self.settings)
        slot.matcher = matcher
        self._emit_start(slot)
        return slot

    # ---- joining and decoding ----

    def _join(self, job: PrefillJob, logits) -> None:
        """Move a prefilled job's rows into the batch (in place) and sample their first tokens."""
        kept = []
        for r, slot in enumerate(job.slots):
            if slot.gen.cancel_reason:
                self.done(slot.gen, slot.gen.cancel_reason, slot)
            else:
                kept.append(r)
        if not kept:
            return
        if self.kv is None and len(kept) == job.rows:
            self.kv = job.kv  # the job's buffer becomes the batch's: no copy
        elif self.kv is None:
            self.kv = KVBuffer(*self.dims, rows=len(kept), capacity=job.kv.length + 64)
        self.kv.reads_padding = not self._native  # the C++ step reads no padding
        if self.kv is not job.kv:
            for r in kept:
                self.kv.add_row(*job.kv.row(r, copy=False))
        slots = [job.slots[r] for r in kept]
        self.rows += slots
        if job.scores is not None:
            for r in kept:  # every prompt token's log probability, before the answer
                job.slots[r].gen.emit(Delta("", prompt_logprobs=grammar.prompt_entries(self.grammars, job.scores[r])))
        rows = logits[kept] if len(kept) < job.rows else logits
        self._accept_all(slots, rows)

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
        """Sample every row's next token in one pass, then emit each row's text.

        A pass that fails is redone row by row, each row's generator first put back where it was (a
        seeded answer stays the same), and a row that fails alone ends alone with ``error``.
        Log probabilities come from the raw logits; a grammar's mask (-inf) goes on before either
        sampler sees them. Rows asked for no tokens (a scored prompt) end here, unsampled.
        """
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
        params, generators = [s.params for s in slots], [s.generator for s in slots]
        states = [g.get_state() if p.temperature else None for p, g in zip(params, generators)]
        try:
            tokens: list = sample(logits, params, generators, native=self._sampler())
        except Exception:
            log.exception("sampling %d rows failed: sampling them one by one", len(slots))
            tokens = [self._sample_alone(slot, logits[r:r + 1], states[r]) for r, slot in enumerate(slots)]
        for j, (slot, token) in enumerate(zip(slots, tokens)):
            if isinstance(token, str):
                self._finish(slot, "error", token)
                continue
            if scores is not None and j in scores and token not in self.loaded.eos_ids:
                slot.pending.append(grammar.entry(self.grammars, scores[j], token, slot.params.logprobs))
            self._accept(slot, token)
        for slot in failed:
            if slot in self.rows:
                log.warning("grammar failed: %s", slot.matcher.get_error())
                self._finish(slot, "stop")

    def _sample_alone(self, slot: Slot, logits, state) -> int | str:
        """One row's next token, or what went wrong with its sampling."""
        try:
            if state is not None:
                slot.generator.set_state(state)
            return sample(logits, [slot.params], [slot.generator], native=self._sampler())[0]
        except Exception as exc:
            log.exception("sampling request %s failed", slot.gen.serial)
            return f"sampling failed ({type(exc).__name__}): this answer ended; the others go on"

    @property
    def _native(self) -> bool:
        """Decode steps run in C++ (``native``): built and checked while idle after start-up."""
        return self.decoder is not None and bool(self.decoder.native)

    def _sampler(self):
        """The C++ sampler once the C++ decode step is in (the same library)."""
        return native.sample if self._native else None

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
            r = self.rows.index(slot)
            if slot.gen.key and reason != "error":
                keys, values = self.kv.row(r)
                fed = slot.prompt_ids + slot.out_ids
                self.prefix.put(slot.gen.key, fed[:keys[0].shape[2]], keys, values)
            self._remove_row(r)
        self.done(slot.gen, reason, slot, message)

    def _remove_row(self, r: int) -> None:
        """The last row takes row ``r``'s place, in the list as in the buffer."""
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

    def _emit_start(self, slot: Slot) -> None:
        slot.gen.emit(Started(len(slot.prompt_ids)))

    def emit_queued(self, gen: Generation, position: int) -> None:
        gen.emit(Queued(position))

    def emit_error(self, gen: Generation, exc: EngineError) -> None:
        gen.emit(Refused(exc.code, exc.message))

    def _delta(self, slot: Slot, text: str, last: bool = False) -> None:
        """Emit a piece of text (with the log probabilities of the tokens it covers); ``last``: the
        answer's end, where entries of tokens that made no text go out too."""
        if not text and not (last and slot.pending):
            return
        if slot.first_delta_at is None and text:
            slot.first_delta_at = time.monotonic()
        entries = tuple(slot.pending)
        slot.pending.clear()
        slot.gen.emit(Delta(text, entries) if entries else Delta(text))

    def done(self, gen: Generation, reason: str, slot: Slot | None = None, message: str | None = None) -> None:
        prompt_tokens, completion_tokens = (len(slot.prompt_ids), len(slot.out_ids)) if slot else (0, 0)
        gen.emit(Done.build(reason, prompt_tokens, completion_tokens, gen.submitted_at,
                            slot.first_delta_at if slot else None, slot.reused if slot else 0, message, message))
