"""The C++ sampler (native.cpp's ``sample``): the exact filtered distribution (temperature, top-k, top-p over
what top-k kept, min-p), ties broken by token id, a grammar's -inf never drawn, the same cost-free selection on
a flat 151,936-token row, and a seeded row's tokens independent of its batch."""
from __future__ import annotations

import math

import pytest
import torch
from test_native import library  # noqa: F401 (the built library, a fixture)

from chat.engine import GenParams
from chat.engine.model import native
from chat.engine.model.sampling import sample, sample_rows

VOCAB = 200
DRAWS = 6000


def reference(logits: torch.Tensor, p: GenParams) -> torch.Tensor:
    """The exact distribution: softmax(l / T), then top-k, top-p over what top-k kept, min-p against the most
    likely; the order most likely first, equal weights by token id (a stable sort); -inf never kept."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order]
    keep = ranked > 0
    if p.top_k:
        keep[p.top_k:] = False
    within = ranked * keep
    before = (torch.cumsum(within, 0) - within) / within.sum()
    keep &= before < p.top_p - 1e-12
    keep &= ranked >= (p.min_p or 0) * ranked[0]
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order] = (ranked * keep) / (ranked * keep).sum()
    return out


def frequencies(logits: torch.Tensor, p: GenParams, draws: int = DRAWS, chunk: int = 200) -> torch.Tensor:
    """Each token's share of ``draws`` draws from one row (in batches of ``chunk`` copies of it)."""
    u = torch.rand(draws, generator=torch.Generator().manual_seed(5))
    rows = logits.repeat(chunk, 1)
    tokens = []
    for i in range(0, draws, chunk):
        part = u[i:i + chunk]
        tokens += native.sample(rows[:len(part)], [p] * len(part), part)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / draws


def close_to(counts: torch.Tensor, want: torch.Tensor, draws: int = DRAWS) -> None:
    assert torch.all(counts[want == 0] == 0), "a token the filters drop was drawn"
    for p, f in zip(want.tolist(), counts.tolist()):  # 5 sigma; a rare token's count is Poisson: a floor
        assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 2 / draws) / draws)


def peaked(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


def with_ties() -> torch.Tensor:
    """Five tokens share the second weight, in three places; a run of equal weights at the tail."""
    x = torch.full((VOCAB,), -3.0)
    x[7] = 2.0
    x[[3, 40, 41, 90, 150]] = 1.0
    x[100:120] = 0.5
    return x


def masked() -> torch.Tensor:
    """A grammar's mask: every other token -inf, the most likely of the raw row among them."""
    x = peaked(1)
    x[int(x.argmax())] += 5
    x[int(x.argmax()) % 2::2] = -math.inf
    return x


CASES = [
    GenParams(temperature=1.0, top_p=1.0),
    GenParams(temperature=0.7, top_p=0.9),
    GenParams(temperature=1.5, top_p=0.9),
    GenParams(temperature=1.0, top_p=1.0, top_k=5),
    GenParams(temperature=1.0, top_p=0.8, top_k=40),
    GenParams(temperature=1.0, top_p=1.0, min_p=0.05),
    GenParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.02),
    GenParams(temperature=1.0, top_p=0.3),
    GenParams(temperature=1.0, top_p=1.0, top_k=1000),  # past the vocabulary: top-k is off
]
ROWS = {"peaked": peaked, "ties": with_ties, "masked": masked}


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}-m{p.min_p}")
def test_frequencies_match_the_exact_filtered_distribution(library, params, row):  # noqa: F811
    logits = ROWS[row]()
    close_to(frequencies(logits, params), reference(logits, params))


@pytest.mark.parametrize("top_k, kept", [(1, [7]), (2, [7, 3]), (4, [7, 3, 40, 41]), (6, [7, 3, 40, 41, 90, 150])])
def test_top_k_cuts_equal_weights_by_token_id(library, top_k, kept):  # noqa: F811
    counts = frequencies(with_ties(), GenParams(temperature=1.0, top_p=1.0, top_k=top_k), 2000)
    assert sorted(counts.nonzero().flatten().tolist()) == sorted(kept)


@pytest.mark.parametrize("params", [GenParams(temperature=1.0, top_p=1.0), GenParams(temperature=2.0, top_k=150),
                                    GenParams(temperature=1.0, top_p=1.0, min_p=1e-9), GenParams(temperature=3.0)])
@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2 ** -24])
def test_a_masked_token_is_never_drawn_even_at_the_ends_of_the_draw(library, params, u):  # noqa: F811
    logits = masked()
    allowed = set(torch.isfinite(logits).nonzero().flatten().tolist())
    assert native.sample(logits[None], [params], torch.tensor([u]))[0] in allowed


def test_a_row_of_one_allowed_token_gives_it(library):  # noqa: F811
    x = torch.full((1, VOCAB), -math.inf)
    x[0, 33] = -2.0
    for p in CASES:
        assert native.sample(x, [p], torch.rand(1)) == [33]


def test_a_flat_vocabulary_keeps_exactly_the_nucleus(library):  # noqa: F811
    """151,936 nearly equal logits (a random-weight model): the tokens drawn at top-p 0.5 are those the
    exact nucleus keeps, and their frequencies are spread as it says (no sort needed to get there)."""
    x = torch.randn(151936, generator=torch.Generator().manual_seed(2)) * 0.3
    p = GenParams(temperature=1.0, top_p=0.5)
    want = reference(x, p)
    draws = 4000
    counts = frequencies(x, p, draws)
    assert torch.all(want[counts > 0] > 0), "a token outside the nucleus was drawn"
    kept = want > 0
    # the nucleus holds half the mass: about half its tokens' weight lies in its upper half by logit
    upper = kept & (x > x[kept].median())
    assert abs(float(counts[upper].sum()) - float(want[upper].sum())) < 5 * math.sqrt(0.25 / draws)


def test_the_cpp_and_torch_samplers_agree_on_a_wide_flat_row(library):  # noqa: F811
    x = torch.randn(4, 151936, generator=torch.Generator().manual_seed(4)) * 0.5
    params = [GenParams(temperature=0.7, top_p=0.9), GenParams(temperature=1.5, top_p=0.9),
              GenParams(temperature=0.7, top_p=0.9, top_k=40), GenParams(temperature=1.0, min_p=0.5)]
    rank = x.argsort(dim=-1, descending=True).argsort(dim=-1)
    for seed in range(5):
        mine = sample(x, params, [torch.Generator().manual_seed(seed) for _ in params], native=native.sample)
        theirs = sample(x, params, [torch.Generator().manual_seed(seed) for _ in params])
        for r, (a, b) in enumerate(zip(mine, theirs)):
            assert abs(int(rank[r, a]) - int(rank[r, b])) <= 1, (seed, r, a, b)


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(library):  # noqa: F811
    mine = GenParams(temperature=0.8, top_p=0.9, top_k=50)
    steps = [peaked(100 + s) for s in range(30)]
    alone_gen = torch.Generator().manual_seed(42)
    alone = [sample_rows(row[None], [mine], [alone_gen], native=native.sample)[0] for row in steps]
    others = [GenParams(temperature=1.0, top_p=1.0), GenParams(temperature=0), GenParams(min_p=0.1, top_k=400),
              GenParams(temperature=1.5, top_p=0.95)]
    gens = [torch.Generator().manual_seed(7 + i) for i in range(len(others))]
    mine_gen = torch.Generator().manual_seed(42)
    together = []
    for s, row in enumerate(steps):
        rows = torch.stack([peaked(s), row, peaked(s + 1), masked(), peaked(s + 2)])
        tokens = sample_rows(rows, [others[0], mine, *others[1:]], [gens[0], mine_gen, *gens[1:]],
                             native=native.sample)
        together.append(tokens[1])
    assert together == alone
