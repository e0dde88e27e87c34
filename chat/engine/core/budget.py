"""Constrained answers that end well: a grammar row's budget and its runaway guards.

A grammar keeps every token legal but never makes a model finish: a small model can fill its whole
``max_tokens`` with one number's digits or one key written again and again, and the answer is cut
mid-value. Three rules here, each switchable (``CHAT_GRAMMAR_CLOSE``, ``CHAT_JSON_MAX_DIGITS``,
``CHAT_JSON_UNIQUE_KEYS``):

- the budget: after each sampled token, the shortest valid ending from the new state is found by
  walking the matcher (a copy) along the tokens that close soonest (llguidance's forced tokens, else
  ``"`` in a string, ``}``, ``]``, ``0``...). When that ending would no longer fit in the tokens left
  (less ``CHAT_GRAMMAR_RESERVE``), only it is allowed from then on, and the answer ends as a complete
  value with reason ``length``; a sampled token after which no ending fits is replaced by the first
  token of the current state's ending, which always fits;
- a number stops taking digits at ``CHAT_JSON_MAX_DIGITS``;
- an object's key is never written twice (a key that would repeat one cannot be closed);
- with parallel tool calls, a call identical to an earlier one ends the answer.

The scanner reads the JSON parts of the answer (all of it for ``response_format``, each
``<tool_call>`` block's body for tools) byte by byte; the masks are llguidance's bit words.
"""
from __future__ import annotations

from typing import Any

import numpy as np

CALL_OPEN, CALL_CLOSE = b"<tool_call>", b"</tool_call>"
WALK_LIMIT = 96  # longest ending looked for; past it the answer is left alone (a pattern the walk cannot close)
FAR = 16  # tokens beyond the last ending's length where the ending is only looked at every EVERY steps
EVERY = 4
AGAIN = 16  # steps before an ending out of reach (longer than WALK_LIMIT) is looked for again
NUMBER = frozenset(b"0123456789.eE+-")
IN_STRING = b'"a0 '  # what closes a string soonest, in order
OUTSIDE = b'}]0",[{nft-1: \n<'  # outside a string


class Vocab:
    """What the guards need to know of every token: its bytes, which continue a number, which hold a quote."""

    def __init__(self, token_bytes: list[bytes], eos_ids: list[int], encode: Any = None) -> None:
        self.bytes = token_bytes
        self.encode = encode  # text -> token ids (the tokenizer's own, shorter, splitting of an ending)
        self.eos, self.eos_ids = eos_ids[0], frozenset(eos_ids)
        n = len(token_bytes)
        self.words = (n + 31) // 32
        number = np.zeros(self.words * 32, dtype=bool)
        self.single: dict[int, int] = {}
        quotes: dict[bytes, list[int]] = {}
        for tid, raw in enumerate(token_bytes):
            if not raw:
                continue
            if raw[0] in NUMBER:
                number[tid] = True
            if len(raw) == 1 and raw[0] not in self.single:
                self.single[raw[0]] = tid
            q = raw.find(b'"')
            if q >= 0 and b"\\" not in raw[:q]:
                quotes.setdefault(raw[:q], []).append(tid)
        self.number_bits = np.packbits(number, bitorder="little").view(np.uint32)
        self.quotes = {k: np.array(v) for k, v in quotes.items()}
        self.prefer_in = [self.single[b] for b in IN_STRING if b in self.single]
        self.prefer_out = [self.single[b] for b in OUTSIDE if b in self.single]


class Scan:
    """Where the answer's JSON stands: containers open (with an object's keys), in a string, in a number."""

    __slots__ = ("active", "calls", "tail", "stack", "string", "escape", "key", "digits", "call")

    def __init__(self, calls: bool) -> None:
        self.calls = calls  # tool calls: JSON only inside each <tool_call> block
        self.active = not calls
        self.tail = b""
        self.stack: list[list] = []  # [kind, keys, expecting a key]
        self.string = self.escape = False
        self.key: bytearray | None = None  # the key being written
        self.digits = -1  # digits of the number being written; -1: not in a number
        self.call = bytearray()  # the tool call block being written

    def copy(self) -> Scan:
        out = Scan.__new__(Scan)
        out.active, out.calls, out.tail, out.string, out.escape = (
            self.active, self.calls, self.tail, self.string, self.escape)
        out.stack = [[k, set(keys), e] for k, keys, e in self.stack]
        out.key = bytearray(self.key) if self.key is not None else None
        out.digits, out.call = self.digits, bytearray(self.call)
        return out

    def feed(self, data: bytes) -> bytes | None:
        """Read ``data``; a tool call block that closed in it (its text), else None."""
        closed = None
        for b in data:
            if self.calls:
                self.call.append(b)
                self.tail = (self.tail + bytes((b,)))[-len(CALL_CLOSE):]
                if not self.active:
                    if self.tail.endswith(CALL_OPEN):
                        self.active, self.call = True, bytearray(CALL_OPEN)
                    elif self.tail.endswith(CALL_CLOSE):
                        closed, self.call = bytes(self.call), bytearray()
                    continue
            self._byte(b)
        return closed

    def _byte(self, b: int) -> None:
        if self.string:
            if self.escape:
                self.escape = False
            elif b == 0x5C:  # backslash
                self.escape = True
            elif b == 0x22:  # the closing quote
                self.string = False
                if self.key is not None and self.stack:
                    self.stack[-1][1].add(bytes(self.key))
                self.key = None
                return
            if self.key is not None:
                self.key.append(b)
            return
        if b in NUMBER:
            if b in b"0123456789":
                self.digits = max(self.digits, 0) + 1
            elif self.digits < 0:
                self.digits = 0
            return
        self.digits = -1
        top = self.stack[-1] if self.stack else None
        if b == 0x22:
            self.string = True
            self.key = bytearray() if top is not None and top[0] == "{" and top[2] else None
        elif b in b"{[":
            self.stack.append(["{" if b == 0x7B else "[", set(), b == 0x7B])
        elif b in b"}]":
            if self.stack:
                self.stack.pop()
            if not self.stack and self.calls:
                self.active = False
        elif b == 0x3A and top is not None:  # ':'
            top[2] = False
        elif b == 0x2C and top is not None and top[0] == "{":
            top[2] = True


def _allowed(bits: np.ndarray, tid: int) -> bool:
    return bool((int(bits[tid >> 5]) >> (tid & 31)) & 1)


class Guard:
    """One constrained row's budget and runaway guards (see the module's docstring)."""

    def __init__(self, vocab: Vocab, matcher: Any, max_new: int, settings: Any, calls: bool) -> None:
        self.vocab, self.matcher, self.max_new = vocab, matcher, max_new
        self.close, self.reserve = settings.grammar_close, settings.grammar_reserve
        self.max_digits, self.unique = settings.json_max_digits, settings.json_unique_keys
        self.scan = Scan(calls)
        self.made: set[bytes] = set()  # tool call blocks written so far
        self.forced: list[int] | None = None  # the ending being written, once the budget closes the answer
        self.closed = False  # the budget ended the answer (reason length)
        self.repeated = False  # a tool call repeated an earlier one: the answer ends there
        self.produced = 0
        self.ending: int | None = None  # the last ending's length, and when it was found
        self.checked_at = -1
        self.rest_until = 0  # no ending within reach: the walk rests until this many tokens
        self.bits = np.zeros(vocab.words, dtype=np.uint32)

    # ---- before sampling: the mask

    def restrict(self, bits: np.ndarray) -> None:
        """Narrow the matcher's mask (``bits``, uint32 words) by the rules; never to nothing."""
        if self.forced is not None or self.repeated:
            only = self.forced[0] if self.forced else self.vocab.eos
            if _allowed(bits, only):  # (a call repeated mid-token: the grammar may want more first)
                bits[:] = 0
                bits[only >> 5] |= np.uint32(1 << (only & 31))
                return
        scan = self.scan
        if not scan.active:
            return
        keep = bits.copy()
        if self.max_digits and scan.digits >= self.max_digits:
            bits &= ~self.vocab.number_bits
        if self.unique and scan.key is not None and scan.stack and not scan.escape:
            written = bytes(scan.key)
            for key in scan.stack[-1][1]:
                if key.startswith(written):
                    ids = self.vocab.quotes.get(key[len(written):])
                    if ids is not None:
                        np.bitwise_and.at(bits, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        if not bits.any():
            bits[:] = keep

    # ---- after sampling: the token taken (its replacement when it leaves no ending room)

    def settle(self, token: int) -> int:
        """The token the row takes: ``token``, or the first of the ending when no ending fits after it."""
        if not self.close or self.forced is not None or self.repeated or self.produced < self.rest_until:
            return token
        left = self.max_new - self.produced - 1 - self.reserve  # tokens left after this one, less the reserve
        if self.ending is not None and left > self.ending + FAR and self.produced - self.checked_at < EVERY:
            return token
        after = self._ending(token)
        self.checked_at = self.produced
        if after is not None and len(after) <= left:
            self.ending = len(after)
            return token
        if after is not None and len(after) <= left + self.reserve:
            self.forced = [token] + after  # fits without the reserve: take it, then close
            return token
        now = self._ending(None)
        if now is None:  # no ending within reach (or none at all): leave the row to its length, for a while
            self.rest_until = self.produced + AGAIN
            return token
        self.forced = now if now else None
        self.repeated = self.repeated or not now  # the grammar may end here: end it
        self.closed = True
        return now[0] if now else self.vocab.eos

    def took(self, token: int) -> None:
        """``token`` was consumed by the matcher: follow it."""
        if self.forced is not None:
            if self.forced and self.forced[0] == token:
                self.forced.pop(0)
                self.closed = True
        if token in self.vocab.eos_ids:
            return
        self.produced += 1
        block = self.scan.feed(self.vocab.bytes[token])
        if block is not None:
            body = block[len(CALL_OPEN):-len(CALL_CLOSE)].strip()
            if body in self.made:
                self.repeated = True
            self.made.add(body)

    def _ending(self, first: int | None) -> list[int] | None:
        """The tokens of the shortest ending found after ``first`` (from here when None); None: none found."""
        m = self.matcher.deep_copy()
        scan = self.scan.copy()
        if first is not None:
            if first in self.vocab.eos_ids:
                return []
            if not m.consume_token(first) or m.is_error():
                return None
            scan.feed(self.vocab.bytes[first])
        out: list[int] = []
        bits = self.bits
        while not m.is_accepting() and not m.is_stopped():
            if len(out) > WALK_LIMIT:
                return None
            forced = m.compute_ff_tokens()
            if forced:
                chosen = forced
            else:
                m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                if m.is_error():
                    return None
                prefer = self.vocab.prefer_in if scan.string else self.vocab.prefer_out
                pick = next((t for t in prefer if _allowed(bits, t)), None)
                if pick is None:
                    nz = np.flatnonzero(bits)
                    if not len(nz):
                        return None
                    word = int(nz[0])
                    pick = word * 32 + (int(bits[word]) & -int(bits[word])).bit_length() - 1
                    if pick in self.vocab.eos_ids:
                        break
                chosen = [pick]
            for t in chosen:
                if not m.consume_token(t):
                    return None
                scan.feed(self.vocab.bytes[t])
                out.append(t)
        if m.is_error():
            return None
        return self._shorter(first, out)

    def _shorter(self, first: int | None, walked: list[int]) -> list[int]:
        """The walked ending as the tokenizer splits its text (fewer tokens), when the grammar takes that."""
        if len(walked) < 2 or self.vocab.encode is None:
            return walked
        try:
            text = b"".join(self.vocab.bytes[t] for t in walked).decode("utf-8")
        except UnicodeDecodeError:
            return walked
        ids = list(self.vocab.encode(text))
        if len(ids) >= len(walked):
            return walked
        m = self.matcher.deep_copy()
        if first is not None:
            m.consume_token(first)
        if m.validate_tokens(ids) != len(ids) or not m.consume_tokens(ids) or not (m.is_accepting() or m.is_stopped()):
            return walked
        return ids
