"""Batched sampling: one vectorized pass over a batch's logits, with a seeded generator per row.

Order of the filters: temperature, then top-k, then top-p over what top-k kept
(renormalized), then min-p (relative to the most likely token). Candidates are
narrowed to the ``narrow`` most likely tokens before anything is sorted; that is
exact, not an approximation: probabilities are normalized over the whole
vocabulary first, and a row whose nucleus does not fit in the candidates is
redone with 16 times as many, then with the whole vocabulary. Each row draws one uniform number from its own
generator, so a seeded answer does not depend on who else is in the batch.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace

import torch

from ..base import GenParams

log = logging.getLogger(__name__)
NARROW = 64  # topk of 64 of 49,152 logits x 8 rows: ~1.3 ms here; of 256: ~6 ms
# Below this a row is greedy: logits ÷ 1e-300 overflow to inf and NaN (noise, not the likeliest text);
# vLLM takes the same floor. At 1e-5 the gap between the top two logits is already 1e5 nats.
MIN_TEMPERATURE = 1e-5


def problem(p: GenParams) -> str | None:
    """Why a row's parameters cannot be sampled with (None when they can): the engine's own last check,
    for whatever slipped past the transports' rules (chat/params.py)."""
    if not isinstance(p.temperature, (int, float)) or not 0 <= p.temperature < math.inf:
        return "temperature must be a finite number of at least 0"
    if not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1:
        return "top_p must be a number greater than 0 and at most 1"
    if p.min_p is not None and (not isinstance(p.min_p, (int, float)) or not 0 <= p.min_p <= 1):
        return "min_p must be a number from 0 to 1"
    if p.top_k is not None and (not isinstance(p.top_k, int) or p.top_k < 0):
        return "top_k must be an integer of at least 0"
    return None


def _safe(p: GenParams, vocab: int) -> GenParams:
    """``p`` as the filters take it: a temperature under the floor is greedy, a top_k past the
    vocabulary is off (the same draw), so no huge or tiny number reaches a tensor."""
    cold = p.temperature != 0 and not MIN_TEMPERATURE <= p.temperature < math.inf
    wide = (p.top_k or 0) > vocab
    if cold or wide:
        return replace(p, temperature=0.0 if cold else p.temperature, top_k=0 if wide else p.top_k)
    return p


def sample(logits: torch.Tensor, params: list, generators: list, narrow: int = NARROW,
           native: Callable | None = None) -> list[int]:
    """Next token of every row: ``logits`` (rows, vocab), one GenParams and torch.Generator per row.
    ``native``: the same draw in one C++ call (``native.sample``), given each row's uniform number."""
    params = [_safe(p, logits.shape[-1]) for p in params]
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if native is not None and logits.device.type == "cpu":
        u = torch.zeros(len(params))
        for i in hot:  # exactly one draw per sampled row and step, as below
            u[i] = torch.rand(1, generator=generators[i])
        return native(logits, params, u)
    # Greedy rows stay argmax.
    tokens = logits.argmax(dim=-1).tolist() if len(hot) < len(params) else [0] * len(params)
    if not hot:
        return tokens
    # Exactly one draw per sampled row and step, from the row's own generator.
    draws = {i: torch.rand(1, generator=generators[i]) for i in hot}
    plain = [i for i in hot if _untruncated(params[i])]
    cut = [i for i in hot if not _untruncated(params[i])]
    if plain:
        _fill(tokens, plain, _sample_full(logits, params, draws, plain))
    if cut:
        _fill(tokens, cut, _sample_truncated(logits, params, draws, cut, narrow))
    return tokens


def sample_rows(logits: torch.Tensor, params: list, generators: list,
                native: Callable | None = None) -> list[int | str]:
    """``sample``, where a row that fails ends alone: a pass that fails is redone row by row, each row's
    generator first put back where it was (a seeded answer stays the same), and a row that fails
    alone gets what went wrong (a message) instead of a token."""
    states = [g.get_state() if p.temperature else None for p, g in zip(params, generators)]
    try:
        return list(sample(logits, params, generators, native=native))
    except Exception:
        log.exception("sampling %d rows failed: sampling them one by one", len(params))
    tokens: list[int | str] = []
    for r, (p, generator, state) in enumerate(zip(params, generators, states)):
        try:
            if state is not None:
                generator.set_state(state)
            tokens.append(sample(logits[r:r + 1], [p], [generator], native=native)[0])
        except Exception as exc:
            log.exception("sampling row %d of %d failed", r, len(params))
            tokens.append(f"sampling failed ({type(exc).__name__}): this answer ended; the others go on")
    return tokens


def _untruncated(p: GenParams) -> bool:
    return p.top_p >= 1.0 and not p.top_k and not p.min_p


def _fill(tokens: list, rows: list, chosen: list) -> None:
    for i, token in zip(rows, chosen):
        tokens[i] = token


def _scaled(logits: torch.Tensor, params: list, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits ÷ temperature, log of each row's normalizer over the whole vocabulary)."""
    index = torch.tensor(rows, device=logits.device)
    temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=logits.dtype)
    x = logits.index_select(0, index) / temps[:, None]
    return x, torch.logsumexp(x, dim=-1, keepdim=True)


def _uniforms(draws: dict, rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([draws[i] for i in rows]).to(device)[:, None]


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of each row's choice by inverse CDF (zero weights are never picked)."""
    cdf = torch.cumsum(weights, dim=-1)
    choice = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return choice.clamp_(max=weights.shape[1] - 1)


def _sample_full(logits: torch.Tensor, params: list, draws: dict, rows: list[int]) -> list[int]:
    """Temperature only: the whole vocabulary, unsorted."""
    x, lse = _scaled(logits, params, rows)
    return _pick(torch.exp(x - lse), _uniforms(draws, rows, x.device)).squeeze(1).tolist()


def _sample_truncated(logits: torch.Tensor, params: list, draws: dict, rows: list[int], narrow: int) -> list[int]:
    """Top-k / top-p / min-p among the most likely candidates; rows they cannot settle get a full sort."""
    x, lse = _scaled(logits, params, rows)
    vocab = x.shape[1]
    top_k = torch.tensor([params[i].top_k or 0 for i in rows], device=x.device)
    width = min(vocab, max(narrow, int(top_k.max())))
    values, candidates = torch.topk(x, width, dim=-1)  # sorted, most likely first
    probs = torch.exp(values - lse)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep = torch.arange(width, device=x.device)[None, :] < k
    # top-p is over what top-k kept; without top-k the mass is the whole vocabulary's (exactly 1).
    mass = torch.where(k <= width, (probs * keep).sum(-1, keepdim=True), torch.ones_like(lse))
    top_p = torch.tensor([params[i].top_p for i in rows], device=x.device, dtype=x.dtype)[:, None]
    min_p = torch.tensor([params[i].min_p or 0.0 for i in rows], device=x.device, dtype=x.dtype)[:, None]
    before = (torch.cumsum(probs * keep, dim=-1) - probs) / mass
    floor = min_p * probs[:, :1]
    keep &= (before < top_p) & (probs >= floor)
    keep[:, 0] = True
    # Settled: the kept set ends inside the candidates (by top-k, by top-p's mass, or by min-p).
    settled = (k <= width) | (before[:, -1:] + probs[:, -1:] / mass >= top_p) | (probs[:, -1:] < floor)
    chosen = _pick(probs * keep, _uniforms(draws, rows, x.device))
    tokens = candidates.gather(1, chosen).squeeze(1).tolist()
    unsettled = [j for j, ok in enumerate(settled.squeeze(1).tolist()) if not ok]
    if unsettled and width < vocab:  # wider, then the whole vocabulary (a full sort is ~15 ms a row)
        again = _sample_truncated(logits, params, draws, [rows[j] for j in unsettled], width * 16)
        for j, token in zip(unsettled, again):
            tokens[j] = token
    return tokens
