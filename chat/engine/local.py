"""The inference engine: the only place that runs the model.

One real OS thread loads the model, warms it up and then runs a continuous
batching loop: requests join the running batch after their own prefill and
leave it at any decode step. All rows share one left-padded KV buffer that
grows in place (no per-step concatenation); each row has its own sampling
parameters and random generator, so a seeded answer does not depend on who
else is in the batch. Finished conversations leave their KV behind in a
bounded LRU so the next turn only prefills what is new.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import logging
import random
import time
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..concurrency import Wakeup, start_real_thread
from ..errors import EngineError, EngineUnavailable, Overloaded
from . import model as model_loader
from . import prompt
from .base import Engine, GenParams, Generation
from .events import Delta, Done, Queued, Refused, Started
from .decoding import IncrementalDecoder, StopMatcher

log = logging.getLogger(__name__)

def _release_memory() -> None:
    """Hand freed heap back to the OS once the batch empties (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _BufferLayer(DynamicLayer):
    """A cache layer that writes into a preallocated buffer owned by a ``KVBuffer``."""

    def __init__(self, owner: "KVBuffer", index: int):
        super().__init__()
        # A weak link: a cycle would keep every replaced batch buffer alive until a full GC.
        self.owner, self.index = weakref.proxy(owner), index
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0


class KVBuffer:
    """Left-padded keys/values for a batch, shape (rows, heads, capacity, dim) per layer."""

    def __init__(self, layers, rows, heads, dim, capacity, dtype, device):
        shape = (rows, heads, max(capacity, 1), dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.mask = torch.zeros((rows, shape[2]), dtype=torch.long, device=device)
        self.length = 0
        self.cache = DynamicCache()
        self.cache.layers = [_BufferLayer(self, i) for i in range(layers)]

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more columns (doubling, so growth is amortized O(1))."""
        need = self.length + extra
        if need <= self.capacity:
            return
        cap = max(need, self.capacity * 2)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
                new[:, :, :self.length] = old[:, :, :self.length]
                store[i] = new
        mask = self.mask.new_zeros((self.rows, cap))
        mask[:, :self.length] = self.mask[:, :self.length]
        self.mask = mask

    def write(self, index, key_states, value_states):
        """Called by each attention layer during a forward pass."""
        q = key_states.shape[2]
        end = self.length + q
        self.keys[index][:, :, self.length:end] = key_states
        self.values[index][:, :, self.length:end] = value_states
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]

    def row(self, r: int, copy: bool = True):
        """(keys, values) of row ``r`` without its left padding (compact copies unless ``copy=False``)."""
        start = self.length - int(self.mask[r, :self.length].sum())
        keys = [k[r:r + 1, :, start:self.length] for k in self.keys]
        values = [v[r:r + 1, :, start:self.length] for v in self.values]
        if copy:
            keys, values = [k.clone() for k in keys], [v.clone() for v in values]
        return keys, values


def _assemble(parts, layers, heads, dim, dtype, device, spare=64) -> KVBuffer:
    """A batch buffer from (keys, values, length) parts, right-aligned with left padding."""
    width = max(n for _, _, n in parts)
    kv = KVBuffer(layers, len(parts), heads, dim, width + spare, dtype, device)
    for r, (keys, values, n) in enumerate(parts):
        off = width - n
        for i in range(layers):
            kv.keys[i][r, :, off:width] = keys[i][0, :, :n]
            kv.values[i][r, :, off:width] = values[i][0, :, :n]
        kv.mask[r, off:width] = 1
    kv.length = width
    return kv


class PrefixCache:
    """Per-conversation KV kept after an answer, bounded in bytes, least recently used out first."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.used = 0
        self.hits = self.misses = 0

    def put(self, key, ids, keys, values) -> None:
        size = sum(t.numel() * t.element_size() for t in keys + values)
        self.pop(key)
        if not key or size > self.budget:
            return
        self.entries[key] = (list(ids), keys, values, size)
        self.used += size
        while self.used > self.budget:
            _, (_, _, _, s) = self.entries.popitem(last=False)
            self.used -= s

    def pop(self, key):
        entry = self.entries.pop(key, None)
        if entry:
            self.used -= entry[3]
        return entry

    def take(self, key, ids):
        """(keys, values, reused length) for the longest shared prefix of ``ids``, or None."""
        entry = self.pop(key) if key else None
        if entry is None:
            self.misses += 1
            return None
        cached, keys, values, _ = entry
        n = 0
        limit = min(len(cached), len(ids) - 1)  # leave at least one token to prefill
        while n < limit and cached[n] == ids[n]:
            n += 1
        if n == 0:
            self.misses += 1
            return None
        self.hits += 1
        return keys, values, n


class Slot:
    """One request in the running batch."""

    def __init__(self, gen: Generation, ids: list[int], tokenizer, settings):
        self.gen = gen
        self.params = gen.params
        self.prompt_ids = ids
        self.out_ids: list[int] = []
        self.pos = len(ids)  # position id of the next token fed to the model
        self.last = None  # last sampled token, fed at the next step
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopMatcher(self.params.stop)
        self.generator = torch.Generator()
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.started = time.monotonic()
        self.deadline = self.started + settings.generation_timeout_s
        self.first_delta_at = None
        self.index = 0
        self.reused = 0
        self.hit_stop = False


class LocalEngine(Engine):
    """Runs the model on its own OS thread with continuous batching."""

    def __init__(self, settings, autostart: bool = True):
        self.settings = settings
        self.model_name = settings.model_name or "loading"
        self.ready = False
        self.error = None
        self.loaded = None
        self.pending: collections.deque = collections.deque()
        self.rows: list[Slot] = []
        self.kv: KVBuffer | None = None
        self.prefix = PrefixCache(settings.kv_cache_mb * 1024 * 1024)
        self.wake = Wakeup()
        self.accepting = True
        self.stopping = None  # reason, once shutdown was asked
        self.trimmed = True
        self.tokens_generated = 0
        if autostart:
            start_real_thread(self._run, name="engine")

    # ---- called from the web layer (any greenlet or thread) ----

    def submit(self, messages, params: GenParams, key=None) -> Generation:
        """Queue a generation; raises ``overloaded`` when the queue is full or stopping."""
        if not self.accepting or self.stopping:
            raise Overloaded("the server is shutting down")
        if self.error:
            raise EngineUnavailable("the model failed to load")
        waiting = len(self.pending) + max(0, len(self.rows) - self.settings.max_batch)
        if len(self.rows) >= self.settings.max_batch and waiting >= self.settings.max_queue:
            raise Overloaded("the server is at capacity; try again shortly")
        gen = Generation(messages=messages, params=params, key=key)
        if self.ready:
            # Fit now, on the caller's side, so a message too long for the context is refused
            # with an error instead of being queued (tokenizing is cheap next to the model).
            gen.prompt_ids = self._fit(gen)
        gen.on_cancel = lambda _g: self.wake.set()
        self.pending.append(gen)
        self.wake.set()
        return gen

    def stats(self) -> dict:
        return {"active": len(self.rows), "queued": len(self.pending),
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
            self._fail_pending("error")
            return
        while True:
            if self.stopping:
                self._finish_all(self.stopping)
                return
            try:
                self._admit()
                if self.rows:
                    self._step()
                    self.trimmed = False
                else:
                    if not self.trimmed:
                        _release_memory()
                        self.trimmed = True
                    self.wake.wait(1.0)
            except Exception:
                # Leave the batch state alone (it may be half-updated): end every row as failed.
                log.exception("engine step failed")
                rows, self.rows, self.kv = self.rows, [], None
                for slot in rows:
                    self._done(slot.gen, "error", len(slot.prompt_ids), len(slot.out_ids), slot)

    def _load(self) -> None:
        with torch.inference_mode():
            self.loaded = model_loader.load(self.settings)
            self.model_name = self.loaded.name
            cfg = self.loaded.model.config.get_text_config(decoder=True)
            self.n_layers = cfg.num_hidden_layers
            self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            if self.settings.warmup:
                self._warmup()
        # Everything loaded so far lives for the whole process: keep it out of the GC's
        # full collections, which otherwise stall the event loop for tenths of a second.
        gc.collect()
        gc.freeze()
        self.ready = True
        log.info("engine ready: %s, max batch %d", self.model_name, self.settings.max_batch)

    def _warmup(self) -> None:
        """Run a tiny generation so the first user does not pay for lazy initialisation."""
        started = time.monotonic()
        ids = prompt.render(self.loaded.tokenizer, [{"role": "user", "content": "Hi"}])
        kv, logits = self._prefill(ids, None)
        token = int(logits[0].argmax())
        for _ in range(3):
            kv.reserve(1)
            kv.mask[:, kv.length] = 1
            out = self._forward(torch.tensor([[token]], device=self.loaded.device),
                                kv, torch.tensor([[len(ids)]], device=self.loaded.device))
            kv.length += 1
            token = int(out[0].argmax())
        log.info("warm-up took %.2f s", time.monotonic() - started)

    def _forward(self, input_ids, kv: KVBuffer, position_ids):
        out = self.loaded.model(input_ids=input_ids, attention_mask=kv.mask[:, :kv.length + input_ids.shape[1]],
                                position_ids=position_ids, cache=kv.cache, use_cache=True,
                                logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _prefill(self, ids, reused):
        """Prefill one prompt into its own buffer, continuing from reused KV when given."""
        device = self.loaded.device
        start = 0
        if reused is not None:
            keys, values, start = reused
            kv = _assemble([(keys, values, start)], self.n_layers, self.n_kv_heads, self.head_dim,
                           self.loaded.dtype, device, spare=len(ids) - start + 64)
        else:
            kv = KVBuffer(self.n_layers, 1, self.n_kv_heads, self.head_dim, len(ids) + 64,
                          self.loaded.dtype, device)
        rest = ids[start:]
        kv.reserve(len(rest))
        kv.mask[:, kv.length:kv.length + len(rest)] = 1
        positions = torch.arange(start, len(ids), device=device).unsqueeze(0)
        logits = self._forward(torch.tensor([rest], device=device), kv, positions)
        kv.length += len(rest)
        return kv, logits

    def _admit(self) -> None:
        """Drop cancelled waiters, move waiters into the batch, tell the rest their position."""
        for gen in [g for g in self.pending if g.cancel_reason]:
            self.pending.remove(gen)
            self._done(gen, gen.cancel_reason, 0, 0, None)
        joining = []
        while self.pending and len(self.rows) + len(joining) < self.settings.max_batch and not self.stopping:
            gen = self.pending.popleft()
            try:
                ids = gen.prompt_ids or self._fit(gen)
            except EngineError as exc:
                gen.emit(Refused(exc.code, exc.message))
                continue
            joining.append(Slot(gen, ids, self.loaded.tokenizer, self.settings))
            gen.emit(Started(len(ids)))
        if joining:
            self._join(joining)
        for position, gen in enumerate(self.pending, 1):
            if gen.position != position:
                gen.position = position
                gen.emit(Queued(position))

    def _fit(self, gen: Generation) -> list[int]:
        """The prompt ids, history trimmed so the answer has room in the context."""
        max_new = min(gen.params.max_new_tokens, self.settings.max_new_tokens)
        budget = self.settings.context_tokens - min(max_new, self.settings.context_tokens // 2)
        return prompt.fit(self.loaded.tokenizer, gen.messages, budget)[0]

    def _join(self, slots: list) -> None:
        """Prefill newcomers (fresh prompts together in one padded pass) and add them to the batch."""
        prefilled = []  # (slot, kv buffer, row in it, logits)
        fresh = []
        with torch.inference_mode():
            for slot in slots:
                reused = self.prefix.take(slot.gen.key, slot.prompt_ids)
                if reused is None:
                    fresh.append(slot)
                    continue
                slot.reused = reused[2]
                kv, logits = self._prefill(slot.prompt_ids, reused)
                prefilled.append((slot, kv, 0, logits[0]))
            if len(fresh) == 1:
                kv, logits = self._prefill(fresh[0].prompt_ids, None)
                prefilled.append((fresh[0], kv, 0, logits[0]))
            elif fresh:
                kv, logits = self._prefill_together([s.prompt_ids for s in fresh])
                prefilled += [(slot, kv, r, logits[r]) for r, slot in enumerate(fresh)]
        kept = []
        for slot, kv, r, logits in prefilled:
            if slot.gen.cancel_reason:
                self._done(slot.gen, slot.gen.cancel_reason, len(slot.prompt_ids), 0, slot)
            else:
                kept.append((slot, kv, r, logits))
        if not kept:
            return
        parts = [self._part(self.kv, r) for r in range(len(self.rows))] if self.kv is not None else []
        parts += [self._part(kv, r) for _, kv, r, _ in kept]
        self.rows += [slot for slot, _, _, _ in kept]
        self.kv = _assemble(parts, self.n_layers, self.n_kv_heads, self.head_dim,
                            self.loaded.dtype, self.loaded.device)
        for slot, _, _, logits in kept:
            self._accept(slot, logits)

    @staticmethod
    def _part(kv: KVBuffer, r: int):
        keys, values = kv.row(r, copy=False)
        return keys, values, keys[0].shape[2]

    def _prefill_together(self, prompts: list):
        """One left-padded forward pass for several fresh prompts."""
        device = self.loaded.device
        width = max(len(ids) for ids in prompts)
        kv = KVBuffer(self.n_layers, len(prompts), self.n_kv_heads, self.head_dim, width + 64,
                      self.loaded.dtype, device)
        input_ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        positions = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for r, ids in enumerate(prompts):
            pad = width - len(ids)
            input_ids[r, pad:] = torch.tensor(ids, device=device)
            positions[r, pad:] = torch.arange(len(ids), device=device)
            kv.mask[r, pad:width] = 1
        logits = self._forward(input_ids, kv, positions)
        kv.length = width
        for r, ids in enumerate(prompts):
            pad = width - len(ids)
            if pad:  # padding rows attend to nothing; keep their never-read KV finite
                for store in (kv.keys, kv.values):
                    for t in store:
                        t[r, :, :pad] = 0
        return kv, logits

    def _sample(self, slot: Slot, logits) -> int:
        temperature, top_p = slot.params.temperature, slot.params.top_p
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            keep = cumulative - sorted_probs < top_p
            keep[0] = True
            sorted_probs = sorted_probs * keep
            choice = torch.multinomial(sorted_probs, 1, generator=slot.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=slot.generator))

    def _accept(self, slot: Slot, logits) -> None:
        """Sample the next token of a row and emit its text; finish the row if it ended."""
        token = self._sample(slot, logits)
        reason = None
        if token in self.loaded.eos_ids:
            reason = "stop"
        else:
            slot.out_ids.append(token)
            slot.last = token
            self.tokens_generated += 1
            text, hit = slot.stopper.push(slot.decoder.push(token))
            self._delta(slot, text)
            if hit:
                slot.hit_stop = True
                reason = "stop"
            elif len(slot.out_ids) >= min(slot.params.max_new_tokens, self.settings.max_new_tokens):
                reason = "length"
            elif slot.pos + 1 >= self.settings.context_tokens:
                reason = "length"
        if reason:
            self._finish(slot, reason)

    def _delta(self, slot: Slot, text: str) -> None:
        if not text:
            return
        if slot.first_delta_at is None:
            slot.first_delta_at = time.monotonic()
        slot.gen.emit(Delta(text))

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
        kv, device = self.kv, self.loaded.device
        kv.reserve(1)
        kv.mask[:, kv.length] = 1
        input_ids = torch.tensor([[s.last] for s in self.rows], device=device)
        positions = torch.tensor([[s.pos] for s in self.rows], device=device)
        with torch.inference_mode():
            logits = self._forward(input_ids, kv, positions)
        kv.length += 1
        for r, slot in enumerate(list(self.rows)):
            slot.pos += 1
            self._accept(slot, logits[r])

    def _finish(self, slot: Slot, reason: str) -> None:
        """End a row: flush its text, keep its KV for the next turn, emit ``done``."""
        if reason != "error" and not slot.hit_stop:
            text, hit = slot.stopper.push(slot.decoder.flush())
            self._delta(slot, text if hit else text + slot.stopper.flush())
        if slot in self.rows:
            r = self.rows.index(slot)
            if slot.gen.key and self.kv is not None and reason != "error":
                keys, values = self.kv.row(r)
                fed = slot.prompt_ids + slot.out_ids
                self.prefix.put(slot.gen.key, fed[:keys[0].shape[2]], keys, values)
            self._remove_row(r)
        self._done(slot.gen, reason, len(slot.prompt_ids), len(slot.out_ids), slot)

    def _remove_row(self, r: int) -> None:
        del self.rows[r]
        if not self.rows:
            self.kv = None
            return
        parts = [self._part(self.kv, i) for i in range(self.kv.rows) if i != r]
        self.kv = _assemble(parts, self.n_layers, self.n_kv_heads, self.head_dim,
                            self.loaded.dtype, self.loaded.device)

    def _done(self, gen: Generation, reason: str, prompt_tokens: int, completion_tokens: int, slot) -> None:
        gen.emit(Done.build(reason, prompt_tokens, completion_tokens, gen.submitted_at,
                            slot.first_delta_at if slot else None, slot.reused if slot else 0))

    def _finish_all(self, reason: str) -> None:
        for slot in list(self.rows):
            self._finish(slot, reason)
        self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        while self.pending:
            self._done(self.pending.popleft(), reason, 0, 0, None)
