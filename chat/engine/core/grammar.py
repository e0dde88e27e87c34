"""Constrained decoding and log probabilities for the engine: llguidance matchers, their token masks
applied to a row's logits before either sampler runs, and each token's log probability from the
model's unmodified distribution.

Why llguidance (measured on the bundled and a 151,936-token vocabulary: docs/models.md): a schema
compiles in 0.5-13 ms, a row's mask costs 17-80 µs a step, and the wheel depends on nothing else.
Matchers are compiled on the submitting request's thread (``run_in_thread``), cached by the
grammar's hash and deep-copied per request; the engine thread only computes masks.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from ...errors import EngineError
from .budget import Vocab

CACHE_SIZE = 128  # compiled grammars kept (most recently used)
TOP_MAX = 20  # alternatives per token, as OpenAI allows


class GrammarError(EngineError):
    """A grammar that does not compile for this model (too large, unsupported)."""

    code, status = "bad_message", 400


class Grammars:
    """The model's llguidance tokenizer (built on first use) and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset, vocab: int) -> None:
        self.hf, self.eos_ids, self.vocab = tokenizer, sorted(eos_ids), vocab
        self._tok: llguidance.LLTokenizer | None = None
        self._vocab: Vocab | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compiled = 0  # compiles (cache misses), for tests and metrics

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:
                self._tok = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab, eos_token=self.eos_ids)
            return self._tok

    @property
    def table(self) -> Vocab:
        """Every token's bytes and classes, for the budget and guards (built on first use)."""
        if self._vocab is None:
            tok = self.tokenizer
            vocab = Vocab([tok.decode_bytes([t]) for t in range(self.vocab)], self.eos_ids,
                          lambda text: self.hf.encode(text, add_special_tokens=False))
            with self._lock:
                self._vocab = self._vocab or vocab
        return self._vocab

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar``; raises ``GrammarError`` when it does not compile."""
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"the schema cannot be used: {template.get_error()}")
            self._first_token(template)
            self.compiled += 1
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def _first_token(self, template: llguidance.LLMatcher) -> None:
        """GrammarError (400) unless the grammar allows a first token that it then accepts: a cyclic
        ``$ref`` allows none, a required infinite recursion fails on its first; either would otherwise
        end as an answer that looks finished and is not valid."""
        probe = template.deep_copy()
        words = (self.vocab + 31) // 32
        bits = np.zeros(words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab])
        if probe.is_error() or not len(allowed):
            raise GrammarError(f"the schema allows no answer: {reason(probe) or 'no first token fits it'}")
        eos = set(self.eos_ids)
        first = next((int(t) for t in allowed if int(t) not in eos), None)
        if first is not None and not probe.consume_token(first) and probe.is_error():
            raise GrammarError(f"the schema allows no answer: {reason(probe)}")

    def token(self, tid: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token, as OpenAI's log probability entries show it."""
        raw = self.tokenizer.decode_bytes([tid])
        return raw.decode("utf-8", errors="replace"), list(raw)


def reason(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's error, its first line (the rest is a dump of the parser's state)."""
    return matcher.get_error().partition("\n")[0][:200]


def failure_message(matcher: llguidance.LLMatcher) -> str:
    """What an answer whose grammar failed mid-way ends with (``done`` reason ``error``)."""
    return f"the answer's format could not be kept: {reason(matcher)}"


def apply_masks(logits: torch.Tensor, slots: list) -> list:
    """-inf on each constrained row's disallowed tokens, in place; the slots whose grammar failed.

    The bits are unpacked and the rows filled with numpy, one thread, row by row: torch's
    multi-threaded ops on a (rows, vocabulary) mask cost tens of ms a step on a busy 2-core box,
    these well under one."""
    rows = [i for i, s in enumerate(slots) if s.matcher is not None]
    if not rows:
        return []
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bits = np.zeros((len(rows), words), dtype=np.int32)
    failed = []
    for j, i in enumerate(rows):
        m = slots[i].matcher
        m.unsafe_compute_mask_ptr(bits[j].ctypes.data, words * 4)
        if m.is_error():  # this step unconstrained (never a row of -inf); the engine ends the row
            bits[j] = -1
            failed.append(slots[i])
        elif slots[i].guard is not None:
            slots[i].guard.restrict(bits[j].view(np.uint32))
    banned = np.unpackbits((~bits).view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(bool)
    if logits.device.type == "cpu" and logits.is_contiguous():
        values = logits.numpy()
        for j, i in enumerate(rows):
            np.copyto(values[i], -np.inf, where=banned[j])
    else:
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index).masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))
        logits.index_copy_(0, index, sub)
    return failed


def settle(slots: list, tokens: list) -> list:
    """The tokens the rows take: a constrained row's sampled token, unless its budget replaces it (budget.py)."""
    return [s.guard.settle(t) if s.guard is not None and not isinstance(t, str) else t for s, t in zip(slots, tokens)]


def log_probs(logits: torch.Tensor, slots: list) -> dict | None:
    """Each row's log-softmax over the raw logits, for the rows that asked (before any mask), or None."""
    rows = [i for i, s in enumerate(slots) if s.params.logprobs is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    return dict(zip(rows, torch.log_softmax(logits.index_select(0, index).float(), dim=-1)))


def entry(grammars: Grammars, lp: torch.Tensor, token: int, top: int) -> dict:
    """One token's OpenAI log probability entry (``top`` alternatives)."""
    text, raw = grammars.token(token)
    alternatives: list[dict] = []
    if top:
        values, ids = torch.topk(lp, min(top, TOP_MAX))
        for value, tid in zip(values.tolist(), ids.tolist()):
            t, b = grammars.token(tid)
            alternatives.append({"token": t, "logprob": value, "bytes": b})
    return {"token": text, "logprob": float(lp[token]), "bytes": raw, "top_logprobs": alternatives}


def prompt_entries(grammars: Grammars, scores: list) -> tuple:
    """A scored prompt's entries from (token id, logprob or None, [(id, logprob)...]) triples."""
    out = []
    for tid, value, top in scores:
        text, raw = grammars.token(tid)
        alts = [dict(zip(("token", "bytes"), grammars.token(t)), logprob=v) for t, v in top]
        out.append({"token": text, "logprob": value, "bytes": raw, "top_logprobs": alts})
    return tuple(out)
