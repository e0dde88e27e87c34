"""Key/value storage: the batch's shared left-padded buffer and the per-conversation prefix cache.

Rows join and leave the batch buffer in place: a join writes one row, a leave
moves the last row into the gap, so neither copies the other rows' KV (a full
rebuild took 0.1-4 s per join or leave at 8-16 rows of 200-2000 tokens, measured on a
busy 2-core box).
"""
from __future__ import annotations

import collections
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .kvdisk import DiskKV


class _BufferLayer(DynamicLayer):
    """A cache layer that writes into a preallocated buffer owned by a ``KVBuffer``."""

    def __init__(self, owner: "KVBuffer", index: int) -> None:
        super().__init__()
        # A weak link: a cycle would keep every replaced buffer alive until a full GC.
        self.owner, self.index = weakref.proxy(owner), index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.length - self.owner.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length - self.owner.start + query_length, 0


class KVBuffer:
    """Left-padded keys/values, per layer (row capacity, heads, column capacity, dim).

    The model sees rows ``[:n]`` and columns ``[start:length]``: every active row's
    tokens end at ``length``; columns before ``start`` belong to rows that left.
    Both capacities grow by doubling, so growth is amortized O(1) per token.
    """

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device, rows: int = 1,
                 capacity: int = 64, active: int = 0) -> None:
        self.layers, self.heads, self.dim, self.dtype, self.device = layers, heads, dim, dtype, device
        self.start = self.length = 0
        self.n = active  # rows taking part; ``active`` rows start empty (a prefill's, written column by column)
        # Whether a decode step reads padding columns (masked, so they must be finite: zeroed). The
        # C++ step reads only each row's own columns: then a long row joining skips zeroing the
        # others' new padding (hundreds of MB at a 2000-token join, most of a second here).
        self.reads_padding = True
        self._allocate(max(rows, 1), max(capacity, 1))
        self.cache = DynamicCache()
        self.cache.layers = [_BufferLayer(self, i) for i in range(layers)]

    def _allocate(self, rows: int, capacity: int) -> None:
        # Uninitialized: zeroing (and so faulting in) the whole capacity cost a running batch a
        # long stall when a long prompt joined. Every column the model reads is written first, or
        # zeroed where it is padding (see add_row), so masked attention never meets a NaN.
        shape = (rows, self.heads, capacity, self.dim)
        self.keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.mask = torch.zeros((rows, capacity), dtype=torch.long, device=self.device)

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def _move(self, rows: int, capacity: int, offset: int) -> None:
        """Reallocate, copying the live region of the active rows to start at column ``offset``."""
        old_keys, old_values, old_mask = self.keys, self.values, self.mask
        live = self.length - self.start
        self._allocate(rows, capacity)
        for new, old in zip(self.keys + self.values, old_keys + old_values):
            new[:self.n, :, offset:offset + live] = old[:self.n, :, self.start:self.length]
        self.mask[:self.n, offset:offset + live] = old_mask[:self.n, self.start:self.length]
        self.start, self.length = offset, offset + live

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more columns, dropping the dead columns before ``start``."""
        if self.length + extra > self.capacity:
            live = self.length - self.start
            self._move(self.mask.shape[0], max(64, 2 * (live + extra)), 0)

    def open(self, count: int, real: torch.Tensor | None = None) -> None:
        """Make room for the next ``count`` columns of every active row and mark them real (or, where ``real``
        (rows, count) is 0, padding): what a forward of ``count`` columns needs first."""
        self.reserve(count)
        self.mask[:self.n, self.length:self.length + count] = 1 if real is None else real

    def advance(self, count: int) -> None:
        """A forward wrote the ``count`` columns opened for it: they are the rows' newest."""
        self.length += count

    def clear(self, r: int, count: int) -> None:
        """Zero row ``r``'s next ``count`` columns (padding a forward wrote: never read, kept finite)."""
        for t in self.keys + self.values:
            t[r, :, self.length:self.length + count] = 0

    def write(self, index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """Called by each attention layer during a forward pass."""
        end = self.length + key_states.shape[2]
        self.keys[index][:self.n, :, self.length:end] = key_states
        self.values[index][:self.n, :, self.length:end] = value_states
        return self.keys[index][:self.n, :, self.start:end], self.values[index][:self.n, :, self.start:end]

    def attention_mask(self, query_length: int) -> torch.Tensor:
        """The mask for a forward pass of ``query_length`` new columns (set them first)."""
        return self.mask[:self.n, self.start:self.length + query_length]

    def row_starts(self, query_length: int) -> list[int]:
        """Where each row's tokens begin, relative to ``start``, once the next ``query_length``
        columns are set in the mask (rows are contiguous: padding is all before their tokens)."""
        width = self.length + query_length - self.start
        return (width - self.mask[:self.n, self.start:self.length + query_length].sum(dim=1)).tolist()

    def row_start(self, r: int) -> int:
        """The first column row ``r`` uses (its tokens are contiguous up to ``length``)."""
        return self.start + self.row_starts(0)[r]

    def row(self, r: int, copy: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(keys, values) of row ``r`` without its left padding (compact copies unless ``copy=False``)."""
        begin = self.row_start(r)
        keys = [k[r:r + 1, :, begin:self.length] for k in self.keys]
        values = [v[r:r + 1, :, begin:self.length] for v in self.values]
        if copy:
            keys, values = [k.clone() for k in keys], [v.clone() for v in values]
        return keys, values

    def add_row(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Append a row from per-layer (1, heads, count, dim) tensors, right-aligned; returns its index."""
        count = keys[0].shape[2]
        rows = self.mask.shape[0]
        shift = max(0, count - self.length)  # a row longer than the buffer pushes the others right
        if self.n == rows or shift:
            new_rows = rows * 2 if self.n == rows else rows
            live = self.length - self.start
            self._move(new_rows, max(self.capacity, 64, 2 * (max(live, count) + 1)), max(count - live, 0))
        r, begin = self.n, self.length - count
        start = min(self.start, begin) if self.n else begin
        for store, part in ((self.keys, keys), (self.values, values)):
            for layer, t in zip(store, part):
                layer[r, :, begin:self.length] = t[0]
                if self.reads_padding:
                    layer[r, :, start:begin] = 0  # the new row's padding
                    if self.n and begin < self.start:  # columns the other rows now see as padding
                        layer[:self.n, :, begin:self.start] = 0
        self.mask[r].zero_()
        self.mask[r, begin:self.length] = 1
        self.n += 1
        self.start = start
        return r

    def remove_row(self, r: int) -> None:
        """Drop row ``r``: the last row moves into its place (callers mirror that order)."""
        last = self.n - 1
        if r != last:
            for layer in self.keys + self.values:
                layer[r, :, self.start:self.length] = layer[last, :, self.start:self.length]
            self.mask[r, self.start:self.length] = self.mask[last, self.start:self.length]
        self.n = last
        if self.n:
            used = self.mask[:self.n, self.start:self.length].any(dim=0)
            self.start += int(used.int().argmax())
        else:
            self.start = self.length


def joined(batch: KVBuffer | None, source: KVBuffer, rows: list[int], reads_padding: bool) -> KVBuffer:
    """The batch's buffer with ``source``'s ``rows`` added in place (``source`` itself, no copy, when the batch
    is empty and they are all of its rows); ``reads_padding``: whether the decode step reads padding."""
    if batch is None and len(rows) == source.n:
        batch = source
    elif batch is None:
        batch = KVBuffer(source.layers, source.heads, source.dim, source.dtype, source.device, rows=len(rows),
                         capacity=source.length + 64)
    batch.reads_padding = reads_padding
    if batch is not source:
        for r in rows:
            batch.add_row(*source.row(r, copy=False))
    return batch


class PrefixCache:
    """KV kept for reuse: each conversation's after an answer (bounded in bytes, least recently used out
    first), and the shared preambles (a system prompt and the template around it, the same for every
    conversation that uses that system prompt; ``share``), which any conversation's first turn reuses.
    A prompt also reuses the longest common prefix of ids held for any other conversation (a question
    asked again in a new conversation, an edited first message, the same attachment).

    A shared entry serves only a prompt whose ids start with exactly its ids (a preamble) or the ids it
    has in common, and only its keys and values are shared: they are copied into the new row, never
    written in place (docs/security.md).

    Sharing goes by identity (``salt``, GenParams.cache_salt, as vLLM's per-tenant cache salt): a
    conversation's entry serves only prompts of the same salt, and a preamble is public (salt None:
    the operator's system prompt) or its salt's alone. ``share_all`` (CHAT_SHARED_PREFIX=all) lets
    every prompt reuse every entry, as before identities were kept apart."""

    PREAMBLES = 8  # shared preambles kept (a few KB to a MB each)
    FETCHED = 8  # entries read from disk for prompts not yet started, at most

    def __init__(self, budget_bytes: int, share_all: bool = False) -> None:
        self.budget = budget_bytes
        self.share_all = share_all
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.preambles: collections.OrderedDict = collections.OrderedDict()  # (ids tuple, salt) -> (keys, values)
        self.used = 0
        self.hits = self.misses = self.shared_hits = 0
        self.disk: DiskKV | None = None  # conversations' entries on disk too (CHAT_KV_DISK_MB)
        # System prompts' preambles seen without their KV held (any thread adds: atomic; the engine pops them
        # with popitem, prefills each alone while idle and shares it: ``share``)
        self.wanted: dict[tuple, None] = {}
        self.forgotten: collections.deque = collections.deque()  # deleted conversations (any thread appends)
        self.fetched: dict[str, tuple] = {}  # entries read from disk (off the engine thread) for prompts on the way

    def put(self, key: str | None, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
            salt: str | None = None) -> None:
        size = sum(t.numel() * t.element_size() for t in keys + values)
        self.pop(key)
        if key and self.disk is not None:
            self.disk.save(key, ids, keys, values, salt)
        if not key or size > self.budget:
            return
        self.entries[key] = (list(ids), keys, values, size, salt)
        self.used += size
        while self.used > self.budget:
            _, (_, _, _, s, _) = self.entries.popitem(last=False)
            self.used -= s

    def pop(self, key: str | None) -> tuple | None:
        entry = self.entries.pop(key, None)
        if entry:
            self.used -= entry[3]
        return entry

    def fetch(self, key: str | None, salt: str | None = None) -> None:
        """Read a conversation's entry from disk when none is held (any thread: a prompt being fitted), for
        ``take`` to find; only one written for the same salt."""
        if key and self.disk is not None and key not in self.entries and key not in self.fetched:
            found = self.disk.load(key, salt)
            if found is not None:
                while len(self.fetched) >= self.FETCHED:  # prompts that never started (cancelled while waiting)
                    try:
                        self.fetched.pop(next(iter(self.fetched)), None)
                    except (RuntimeError, StopIteration):  # the engine thread took one meanwhile
                        break
                self.fetched[key] = found

    def forget(self, key: str) -> None:
        """A deleted conversation (any thread): its file off the disk now, its entry out of memory at the engine
        thread's next ``tidy``."""
        self.forgotten.append(key)
        if self.disk is not None:
            self.disk.drop(key)

    def tidy(self) -> None:
        """Drop the entries of conversations deleted since the last call (the engine thread)."""
        while self.forgotten:
            key = self.forgotten.popleft()
            self.pop(key)
            self.fetched.pop(key, None)

    def want(self, ids: list[int], salt: str | None = None) -> None:
        """Note a system prompt's preamble for prefilling while idle, unless it is held (any thread);
        ``salt``: whose it is (None: public, the operator's system prompt)."""
        found = (tuple(ids), None if self.share_all else salt)
        if len(found[0]) >= 4 and len(self.wanted) < 16 and found not in self.preambles:
            self.wanted[found] = None

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def share(self, ids: list[int] | tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor],
              salt: str | None = None) -> None:
        """Keep a preamble's KV (computed for ``ids`` alone) for every conversation that starts with it
        (of ``salt``; None: anyone's)."""
        found = (tuple(ids), None if self.share_all else salt)
        self.preambles[found] = (keys, values)
        self.preambles.move_to_end(found)
        while len(self.preambles) > self.PREAMBLES:
            self.preambles.popitem(last=False)

    def has_preamble(self, ids: list[int] | tuple[int, ...], salt: str | None = None) -> bool:
        return (tuple(ids), None if self.share_all else salt) in self.preambles

    def _same(self, salt: str | None, other: str | None) -> bool:
        """Whether a prompt of ``salt`` may reuse an entry kept for ``other``."""
        return self.share_all or salt == other

    def take(self, key: str | None, ids: list[int], shared: bool = True, salt: str | None = None) -> tuple | None:
        """(keys, values, reused length) for the longest prefix of ``ids`` held: the conversation's own
        entry (taken out: the conversation goes on from it) or, with ``shared``, a preamble it may use or
        another conversation's entry of the same salt (views: copied by the caller); None when none holds one."""
        entry = self.pop(key) if key else None
        if entry is None and key in self.fetched:  # read from disk while the prompt was fitted
            cached, keys, values = self.fetched.pop(key)
            entry = (cached, keys, values, 0, salt)  # loaded only when written for this salt
        if entry is not None and not self._same(salt, entry[4]):
            entry = None
        limit = len(ids) - 1  # leave at least one token to prefill
        n = 0
        if entry is not None:
            cached, keys, values, _, _ = entry
            limit_own = min(len(cached), limit)
            while n < limit_own and cached[n] == ids[n]:
                n += 1
        preamble = self._preamble(ids, limit, salt) if shared else None
        other = self._common(ids, limit, salt) if shared else None
        if other is not None and other[0] > max(n, len(preamble[0][0]) if preamble else 0):
            self.shared_hits += 1
            n, found = other
            _, keys, values, _, _ = self.entries[found]
            self.entries.move_to_end(found)
        elif preamble is not None and len(preamble[0][0]) > n:
            self.shared_hits += 1
            found, (keys, values) = preamble
            self.preambles.move_to_end(found)
            n = len(found[0])
        elif n == 0:
            self.misses += 1
            return None
        else:
            self.hits += 1
        return [k[:, :, :n] for k in keys], [v[:, :, :n] for v in values], n

    def _common(self, ids: list[int], limit: int, salt: str | None) -> tuple[int, str] | None:
        """(length, key) of the longest common prefix of ``ids`` (up to ``limit``) with another
        conversation's held ids of the same salt, or None."""
        best: tuple[int, str] | None = None
        for key, (cached, _, _, _, other) in self.entries.items():
            if not cached or cached[0] != ids[0] or not self._same(salt, other):
                continue
            n, top = 0, min(len(cached), limit)
            while n < top and cached[n] == ids[n]:
                n += 1
            if best is None or n > best[0]:
                best = (n, key)
        return best if best and best[0] > 0 else None

    def _preamble(self, ids: list[int], limit: int, salt: str | None) -> tuple | None:
        """((ids, salt), kv) of the longest preamble that ``ids`` starts with (and goes past) and that a
        prompt of ``salt`` may use (a public one or its own), or None."""
        best = None
        for found, kv in self.preambles.items():
            pre, owner = found
            if owner is not None and owner != salt:
                continue
            if len(pre) <= limit and (best is None or len(pre) > len(best[0][0])) and tuple(ids[:len(pre)]) == pre:
                best = (found, kv)
        return best
