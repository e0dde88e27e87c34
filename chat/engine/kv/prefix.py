"""The prefix cache: conversations' KV kept between turns, and the shared preambles (system prompts).

Entries hold keys and values copied out of the batch's buffer (``buffer.py``); a conversation's go to
disk too where ``CHAT_KV_DISK_MB`` allows (``disk.py``).
"""
from __future__ import annotations

import collections

import torch

from .disk import DiskKV


class PrefixCache:
    """KV kept for reuse: each conversation's after an answer (bounded in bytes, least recently used out
    first), and the shared preambles (a system prompt and the template around it, the same for every
    conversation that uses that system prompt; ``share``), which any conversation's first turn reuses.
    A prompt also reuses the longest common prefix of ids held for any other conversation (a question
    asked again in a new conversation, an edited first message, the same attachment).

    A shared entry serves only a prompt whose ids start with exactly its ids (a preamble) or the ids it
    has in common, and only its keys and values are shared: they are copied into the new row, never
    written in place (docs/security.md)."""

    PREAMBLES = 8  # shared preambles kept (a few KB to a MB each)
    FETCHED = 8  # entries read from disk for prompts not yet started, at most

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.preambles: collections.OrderedDict = collections.OrderedDict()  # ids tuple -> (keys, values)
        self.used = 0
        self.hits = self.misses = self.shared_hits = 0
        self.disk: DiskKV | None = None  # conversations' entries on disk too (CHAT_KV_DISK_MB)
        # System prompts' preambles seen without their KV held (any thread adds: atomic; the engine pops them
        # with popitem, prefills each alone while idle and shares it: ``share``)
        self.wanted: dict[tuple, None] = {}
        self.forgotten: collections.deque = collections.deque()  # deleted conversations (any thread appends)
        self.fetched: dict[str, tuple] = {}  # entries read from disk (off the engine thread) for prompts on the way

    def put(self, key: str | None, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in keys + values)
        self.pop(key)
        if key and self.disk is not None:
            self.disk.save(key, ids, keys, values)
        if not key or size > self.budget:
            return
        self.entries[key] = (list(ids), keys, values, size)
        self.used += size
        while self.used > self.budget:
            _, (_, _, _, s) = self.entries.popitem(last=False)
            self.used -= s

    def pop(self, key: str | None) -> tuple | None:
        entry = self.entries.pop(key, None)
        if entry:
            self.used -= entry[3]
        return entry

    def fetch(self, key: str | None) -> None:
        """Read a conversation's entry from disk when none is held (any thread: a prompt being fitted), for
        ``take`` to find."""
        if key and self.disk is not None and key not in self.entries and key not in self.fetched:
            found = self.disk.load(key)
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

    def want(self, ids: list[int]) -> None:
        """Note a system prompt's preamble for prefilling while idle, unless it is held (any thread)."""
        found = tuple(ids)
        if len(found) >= 4 and len(self.wanted) < 16 and found not in self.preambles:
            self.wanted[found] = None

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def share(self, ids: list[int] | tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep a preamble's KV (computed for ``ids`` alone) for every conversation that starts with it."""
        self.preambles[tuple(ids)] = (keys, values)
        self.preambles.move_to_end(tuple(ids))
        while len(self.preambles) > self.PREAMBLES:
            self.preambles.popitem(last=False)

    def has_preamble(self, ids: list[int] | tuple[int, ...]) -> bool:
        return tuple(ids) in self.preambles

    def take(self, key: str | None, ids: list[int], shared: bool = True) -> tuple | None:
        """(keys, values, reused length) for the longest prefix of ``ids`` held: the conversation's own
        entry (taken out: the conversation goes on from it) or, with ``shared``, a shared preamble (views:
        copied by the caller); None when neither holds one."""
        entry = self.pop(key) if key else None
        if entry is None and key in self.fetched:  # read from disk while the prompt was fitted
            cached, keys, values = self.fetched.pop(key)
            entry = (cached, keys, values, 0)
        limit = len(ids) - 1  # leave at least one token to prefill
        n = 0
        if entry is not None:
            cached, keys, values, _ = entry
            limit_own = min(len(cached), limit)
            while n < limit_own and cached[n] == ids[n]:
                n += 1
        preamble = self._preamble(ids, limit) if shared else None
        other = self._common(ids, limit) if shared else None
        if other is not None and other[0] > max(n, len(preamble[0]) if preamble else 0):
            self.shared_hits += 1
            n, found = other
            _, keys, values, _ = self.entries[found]
            self.entries.move_to_end(found)
        elif preamble is not None and len(preamble[0]) > n:
            self.shared_hits += 1
            found, (keys, values) = preamble
            self.preambles.move_to_end(found)
            n = len(found)
        elif n == 0:
            self.misses += 1
            return None
        else:
            self.hits += 1
        return [k[:, :, :n] for k in keys], [v[:, :, :n] for v in values], n

    def _common(self, ids: list[int], limit: int) -> tuple[int, str] | None:
        """(length, key) of the longest common prefix of ``ids`` (up to ``limit``) with another
        conversation's held ids, or None."""
        best: tuple[int, str] | None = None
        for key, (cached, _, _, _) in self.entries.items():
            if not cached or cached[0] != ids[0]:
                continue
            n, top = 0, min(len(cached), limit)
            while n < top and cached[n] == ids[n]:
                n += 1
            if best is None or n > best[0]:
                best = (n, key)
        return best if best and best[0] > 0 else None

    def _preamble(self, ids: list[int], limit: int) -> tuple | None:
        """The longest shared preamble that ``ids`` starts with (and goes past), or None."""
        best = None
        for found, kv in self.preambles.items():
            if len(found) <= limit and (best is None or len(found) > len(best[0])) and tuple(ids[:len(found)]) == found:
                best = (found, kv)
        return best
