"""Batched sampling: the distribution after temperature/top-k/top-p/min-p, seeds, greedy rows."""
from __future__ import annotations

import math

import pytest
import torch

from chat.engine import GenParams
from chat.engine.model.sampling import sample

VOCAB = 200
DRAWS = 6000


def logits_vector(seed: int = 0) -> torch.Tensor:
    """A fixed, moderately peaked row of logits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 2.5


def expected(logits: torch.Tensor, p: GenParams) -> torch.Tensor:
    """The reference: softmax(l / T), keep top-k, nucleus over what is kept, then min-p; renormalized."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    ranked = probs[order]
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if p.top_k:
        keep[p.top_k:] = False
    within = ranked * keep
    before = (torch.cumsum(within, 0) - within) / within.sum()
    keep &= before < p.top_p
    keep &= ranked >= p.min_p * ranked[0]
    keep[0] = True
    out = torch.zeros(VOCAB, dtype=torch.float64)
    out[order] = (ranked * keep) / (ranked * keep).sum()
    return out


CASES = [
    GenParams(temperature=1.0, top_p=1.0),
    GenParams(temperature=0.7, top_p=0.9),
    GenParams(temperature=1.3, top_p=0.95),
    GenParams(temperature=1.0, top_p=1.0, top_k=5),
    GenParams(temperature=1.0, top_p=0.8, top_k=40),
    GenParams(temperature=1.0, top_p=1.0, min_p=0.05),
    GenParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.02),
]


@pytest.mark.parametrize("narrow", [4, 256])  # 4 forces the full-sort fallback for wide nuclei
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}-m{p.min_p}")
def test_frequencies_match_the_filtered_distribution(params, narrow):
    logits = logits_vector()
    batch = logits.repeat(DRAWS, 1)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(DRAWS)]
    tokens = sample(batch, [params] * DRAWS, gens, narrow=narrow)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / DRAWS
    want = expected(logits, params)
    assert torch.all(counts[want == 0] == 0), "a filtered-out token was drawn"
    for p, f in zip(want.tolist(), counts.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9


def test_greedy_rows_are_argmax_beside_sampled_rows():
    logits = torch.stack([logits_vector(s) for s in range(4)])
    params = [GenParams(temperature=0), GenParams(temperature=1.0), GenParams(temperature=0), GenParams(top_k=3)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = sample(logits, params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    mine = GenParams(temperature=0.8, top_p=0.9, top_k=50)
    steps = [logits_vector(100 + s) for s in range(30)]
    alone_gen = torch.Generator().manual_seed(42)
    alone = [sample(row[None, :], [mine], [alone_gen])[0] for row in steps]
    others = [GenParams(temperature=1.0, top_p=1.0), GenParams(temperature=0), GenParams(min_p=0.1, top_k=400)]
    batch_gens = [torch.Generator().manual_seed(7 + i) for i in range(3)]
    mine_gen = torch.Generator().manual_seed(42)
    together = []
    for s, row in enumerate(steps):
        rows = torch.stack([logits_vector(s), row, logits_vector(s + 1), logits_vector(s + 2)])
        tokens = sample(rows, [others[0], mine, others[1], others[2]], [batch_gens[0], mine_gen, *batch_gens[1:]],
                        narrow=4 if s % 2 else 256)
        together.append(tokens[1])
    assert together == alone


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}-m{p.min_p}")
def test_a_grammars_masked_tokens_are_never_drawn(params):
    """-inf on every other token (a grammar's mask), the raw row's likeliest among them: the draws follow the
    filtered distribution over the allowed tokens only."""
    logits = logits_vector(3)
    logits[int(logits.argmax()) % 2::2] = -math.inf
    batch = logits.repeat(2000, 1)
    tokens = sample(batch, [params] * 2000, [torch.Generator().manual_seed(i) for i in range(2000)], narrow=4)
    assert all(math.isfinite(float(logits[t])) for t in tokens)
