"""The batch's shared left-padded key/value buffer.

Rows join and leave the batch buffer in place: a join writes one row, a leave
moves the last row into the gap, so neither copies the other rows' KV (a full
rebuild took 0.1-4 s per join or leave at 8-16 rows of 200-2000 tokens, measured on a
busy 2-core box).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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


# A windowed layer's row, taken out of a buffer (``KVBuffer.row``: the prefix cache, the disk), keeps its window's
# columns and this many more: a later prompt may go on from up to this many columns before the row's end.
TRIM_SLACK = 64


# A windowed layer's ring in a batch buffer (``KVBuffer(rings=True)``) holds what a row taken out keeps and this many
# more columns: a drafted step writes up to this many columns past the answer's end (``drafts.MAX_DRAFT`` + 1) over
# the ring's oldest slots, and the ones the answer does not keep must not have overwritten any kept column.
RING_SLACK = 16


def windows_kept(windows: Sequence[int]) -> tuple[int, ...]:
    """The columns a row keeps per layer (0: all) for layers attending over ``windows`` (0: everything)."""
    return tuple(w - 1 + TRIM_SLACK if w else 0 for w in windows)


def cut(t: torch.Tensor, total: int, n: int) -> torch.Tensor | None:
    """A row's layer tensor (its last ``t.shape[2]`` of ``total`` columns: trimmed, ``KVBuffer.row``) up to column
    ``n``; None where a trimmed one cannot give it (more than ``TRIM_SLACK`` columns dropped from its end would
    leave less than its window before ``n``)."""
    m = t.shape[2]
    if m == total:
        return t[:, :, :n]
    if total - n > TRIM_SLACK:
        return None
    return t[:, :, :m - (total - n)]


class KVBuffer:
    """Left-padded keys/values, per layer (row capacity, heads, column capacity, dim).

    The model sees rows ``[:n]`` and columns ``[start:length]``: every active row's
    tokens end at ``length``; columns before ``start`` belong to rows that left.
    Both capacities grow by doubling, so growth is amortized O(1) per token.

    ``keep``: per layer, the columns a row taken out keeps (0: all; ``windows_kept``): a windowed layer's row
    out of the buffer holds its window and ``TRIM_SLACK`` more, and a row added back gets zeros before them,
    columns no query of it reads (out of every later column's window: masked, and the C++ step skips them).

    ``rings``: a windowed layer holds only its last ``keep + RING_SLACK`` columns, column c at slot c mod that
    (the C++ step indexes them so), so its memory stays bounded however long the answers grow; torch's forward over
    such a buffer sees zeros (masked) before them. A buffer the C++ step decodes (it reads no padding) has them.
    """

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device, rows: int = 1,
                 capacity: int = 64, active: int = 0, keep: Sequence[int] | None = None, rings: bool = False) -> None:
        self.layers, self.heads, self.dim, self.dtype, self.device = layers, heads, dim, dtype, device
        self.keep = tuple(keep) if keep else (0,) * layers
        # per layer: its ring's columns (0: a column per buffer column)
        self.ring = tuple(kept + RING_SLACK if kept and rings else 0 for kept in self.keep)
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
        # A ring is zeroed (small): a slot a row never wrote holds another row's finite values, or zeros.
        def new(ring: int) -> torch.Tensor:
            if ring:
                return torch.zeros((rows, self.heads, ring, self.dim), dtype=self.dtype, device=self.device)
            return torch.empty((rows, self.heads, capacity, self.dim), dtype=self.dtype, device=self.device)
        self.keys = [new(ring) for ring in self.ring]
        self.values = [new(ring) for ring in self.ring]
        self.mask = torch.zeros((rows, capacity), dtype=torch.long, device=self.device)

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def _move(self, rows: int, capacity: int, offset: int) -> None:
        """Reallocate, copying the live region of the active rows to start at column ``offset``."""
        old_keys, old_values, old_mask = self.keys, self.values, self.mask
        live = self.length - self.start
        self._allocate(rows, capacity)
        for new, old, ring in zip(self.keys + self.values, old_keys + old_values, self.ring * 2):
            if ring:  # column c moves to c + offset - start: its slot turns with it
                new[:self.n] = torch.roll(old[:self.n], (offset - self.start) % ring, dims=2)
            else:
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

    def close(self, count: int) -> None:
        """Unmark the next ``count`` columns (opened and written, but not advanced over: a drafted step's columns
        the answer did not keep), so no later mask reads them as real."""
        self.mask[:, self.length:self.length + count] = 0

    def settle(self, kept: list[int], opened: int,
               move: Callable[["KVBuffer", list[tuple[int, int, int, int]]], None]) -> None:
        """After a step that opened ``opened`` columns for every row but in which row r keeps only its first
        ``kept[r]`` (at least one; drafts beyond one row): the rows' tokens end together again at the new
        ``length``. A row that kept fewer than the most has its columns moved right by the difference (``move``:
        (row, first column, last, by) each, in every layer: ``native.shift``), its columns before them now padding;
        the columns no row keeps are closed."""
        most = max(kept)
        moves = []
        starts = self.row_starts(0)
        for r, k in enumerate(kept):
            if k < most:
                first = self.start + starts[r]
                moves.append((r, first, self.length + k, most - k))
        if moves:
            move(self, moves)
            for r, first, _, by in moves:
                self.mask[r, first:first + by] = 0
        self.mask[:self.n, self.length:self.length + most] = 1
        self.mask[:, self.length + most:self.length + opened] = 0
        self.length += most

    def clear(self, r: int, count: int) -> None:
        """Zero row ``r``'s next ``count`` columns (padding a forward wrote: never read, kept finite)."""
        for t, ring in zip(self.keys + self.values, self.ring * 2):
            t[r, :, self._slots(ring, self.length, self.length + count)] = 0

    def _slots(self, ring: int, begin: int, end: int) -> slice | torch.Tensor:
        """Where columns [begin, end) live in a layer: those columns, or their slots in its ring."""
        if not ring:
            return slice(begin, end)
        return torch.arange(begin, end, device=self.device).remainder_(ring)

    def write(self, index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """Called by each attention layer during a forward pass."""
        end = self.length + key_states.shape[2]
        ring = self.ring[index]
        if ring:  # the new columns into their slots; the columns before the ring's as zeros
            assert key_states.shape[2] <= TRIM_SLACK + RING_SLACK, "a ring takes a few columns a forward"
            slots = self._slots(ring, self.length, end)
            self.keys[index][:self.n, :, slots] = key_states
            self.values[index][:self.n, :, slots] = value_states
            first = max(self.start, end - ring)
            held = self._slots(ring, first, end)
            out = []
            for store in (self.keys, self.values):
                t = store[index].new_zeros((self.n, self.heads, end - self.start, self.dim))
                t[:, :, first - self.start:] = store[index][:self.n, :, held]
                out.append(t)
            return tuple(out)
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
        """(keys, values) of row ``r`` without its left padding (compact copies unless ``copy=False``); a windowed
        layer's only its last ``keep`` columns."""
        begin = self.row_start(r)
        firsts = [max(begin, self.length - kept) if kept else begin for kept in self.keep]
        keys = [k[r:r + 1, :, self._slots(ring, first, self.length)]
                for k, first, ring in zip(self.keys, firsts, self.ring)]
        values = [v[r:r + 1, :, self._slots(ring, first, self.length)]
                  for v, first, ring in zip(self.values, firsts, self.ring)]
        if copy:
            keys, values = [k.clone() for k in keys], [v.clone() for v in values]
        return keys, values

    def add_row(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Append a row from per-layer (1, heads, count, dim) tensors, right-aligned; returns its index. A layer's
        tensor with fewer columns (a windowed layer's, ``row``) holds the row's last ones: zeros before them."""
        count = max(k.shape[2] for k in keys)
        rows = self.mask.shape[0]
        shift = max(0, count - self.length)  # a row longer than the buffer pushes the others right
        if self.n == rows or shift:
            new_rows = rows * 2 if self.n == rows else rows
            live = self.length - self.start
            self._move(new_rows, max(self.capacity, 64, 2 * (max(live, count) + 1)), max(count - live, 0))
        r, begin = self.n, self.length - count
        start = min(self.start, begin) if self.n else begin
        for store, part in ((self.keys, keys), (self.values, values)):
            for layer, t, ring in zip(store, part, self.ring):
                if ring:  # its last columns into their slots (the ring's others: never read by this row)
                    kept = min(t.shape[2], ring)
                    layer[r, :, self._slots(ring, self.length - kept, self.length)] = t[0, :, t.shape[2] - kept:]
                    continue
                layer[r, :, self.length - t.shape[2]:self.length] = t[0]
                if t.shape[2] < count:
                    layer[r, :, begin:self.length - t.shape[2]] = 0
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
            for layer, ring in zip(self.keys + self.values, self.ring * 2):
                if ring:
                    layer[r] = layer[last]
                else:
                    layer[r, :, self.start:self.length] = layer[last, :, self.start:self.length]
            self.mask[r, self.start:self.length] = self.mask[last, self.start:self.length]
        self.n = last
        if self.n:
            used = self.mask[:self.n, self.start:self.length].any(dim=0)
            self.start += int(used.int().argmax())
        else:
            self.start = self.length

    def use_rings(self) -> None:
        """Hold each windowed layer (``keep``) in a ring from now on: its columns beyond the ring's are let go."""
        ring = tuple(kept + RING_SLACK if kept else 0 for kept in self.keep)
        for i, size in enumerate(ring):
            if not size or self.ring[i]:
                continue
            first = max(self.start, self.length - size)
            for store in (self.keys, self.values):
                old = store[i]
                store[i] = old.new_zeros((old.shape[0], self.heads, size, self.dim))
                store[i][:, :, self._slots(size, first, self.length)] = old[:, :, first:self.length]
        self.ring = ring


def joined(batch: KVBuffer | None, source: KVBuffer, rows: list[int], reads_padding: bool) -> KVBuffer:
    """The batch's buffer with ``source``'s ``rows`` added in place (``source`` itself, no copy, when the batch
    is empty and they are all of its rows); ``reads_padding``: whether the decode step reads padding (else the
    C++ step decodes it: its windowed layers go in rings, ``KVBuffer``)."""
    if batch is None and len(rows) == source.n:
        batch = source
        if not reads_padding:
            batch.use_rings()
    elif batch is None:
        batch = KVBuffer(source.layers, source.heads, source.dim, source.dtype, source.device, rows=len(rows),
                         capacity=source.length + 64, keep=source.keep, rings=not reads_padding)
    batch.reads_padding = reads_padding
    if batch is not source:
        for r in rows:
            batch.add_row(*source.row(r, copy=False))
    return batch
