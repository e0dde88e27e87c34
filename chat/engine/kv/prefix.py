"""The prefix cache: conversations' KV kept between turns, and the shared preambles (system prompts).

Entries hold keys and values copied out of the batch's buffer (``buffer.py``); a conversation's go to
disk too where ``CHAT_KV_DISK_MB`` allows (``disk.py``).
"""
from __future__ import annotations

import collections

import torch

from .buffer import cut
from .disk import DiskKV


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
            kind = "shared"
            n, found = other
            _, keys, values, _, _ = self.entries[found]
            self.entries.move_to_end(found)
        elif preamble is not None and len(preamble[0][0]) > n:
            kind = "shared"
            found, (keys, values) = preamble
            self.preambles.move_to_end(found)
            n = len(found[0])
        elif n == 0:
            self.misses += 1
            return None
        else:
            kind = "own"
        # a windowed layer's entry holds its last columns only (``KVBuffer.row``): it goes on from near its end
        total = max(k.shape[2] for k in keys)
        kept = [cut(t, total, n) for t in keys + values]
        if any(t is None for t in kept):
            self.misses += 1
            return None
        if kind == "shared":
            self.shared_hits += 1
        else:
            self.hits += 1
        return kept[:len(keys)], kept[len(keys):], n

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
