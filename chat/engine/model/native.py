"""The decode step as one C++ call (``kernels/native.cpp``), compiled on this machine the first time.

Eager torch spends ~40 operator calls a layer of a decode step on vectors of a
few hundred numbers, ~3 µs each on this project's 2-core box: more than their
arithmetic, and about half of a one-row step. ``native.cpp`` runs every layer of
a decode step in one call: the four products on ATen's kernels (int4 or dense,
picked as ``quant.Linear`` picks), the norms, rotary positions, key/value writes,
attention and SwiGLU as plain loops (a one-row step 17 -> 9 ms here). The same
library samples the next tokens (``sample``: the filters as a selection over a histogram of the
weights, never a sort of the vocabulary, so ~0.3 ms a row whatever the distribution).

The library is built and kept by ``kernels/build.py``; this module gives a decoder its step.
Its loops keep bf16 in memory and compute in float32, so they need no bf16 instruction: the step runs
on every class. Before the engine switches to it, its logits are checked against the eager step's on a fixed input
(``agrees``: within rounding).
Without a compiler, with ``CHAT_NATIVE=off``, or if the check fails, decode steps
stay on torch ops.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from ..kernels import quant
from ..kernels.build import library, loaded_paths
from ..kernels.cpu import Cpu
from ..kv.buffer import KVBuffer

if TYPE_CHECKING:
    from .decoder import Decoder

log = logging.getLogger(__name__)


# What the C++ step computes beyond the Llama core (architecture.FEATURES): a bias on any product, q/k head norms,
# layers without rotary positions, fused products (read as any), and Gemma 3's block (its embeddings are scaled
# before the step).
COVERS = frozenset({"qkv_bias", "o_bias", "qk_norm", "no_rope", "fused", "embed_scale", "gemma_norms", "gelu",
                    "sliding_window"})
NO_ROPE, SLIDING = 1, 2  # a layer's kind (native.cpp)
GEMMA_NORMS, GELU = 1, 2  # the model's style
NEAR = 0.999  # ``agrees``: the cosine of the C++ step's logits with torch's that passes at once
ROUNDING = 2.0  # ``agrees``, else: how many times torch's own distance from float32 activations the C++ step may be


class Step:
    """Every layer of ``decoder`` for a decode step, in one call: (rows, hidden) embeddings ->
    hidden states before the final norm. The weights are shared with the decoder, not copied."""

    def __init__(self, decoder: Decoder) -> None:
        missing = decoder.architecture.features - COVERS
        if missing:
            raise RuntimeError(f"{decoder.architecture.name} needs {', '.join(sorted(missing))}")
        norms, tensors, layout, biases, crossovers, kinds = [], [], [], [], [], []
        s = decoder.shape
        for i, layer in enumerate(decoder.layers):
            empty = torch.empty(0)
            norms += [layer.attn_norm, layer.mlp_norm, *(t if t is not None else empty for t in (
                layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_mlp_norm))]
            kinds.append((NO_ROPE if i in s.no_rope else 0)
                         | (SLIDING if s.window and decoder.architecture.sliding(i) else 0))
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                layout.append(int(linear.dense is not None))
                tensors += [linear.dense] if linear.dense is not None else []
                segments = quant.parts(linear.quant) if linear.quant is not None else []
                layout.append(len(segments))
                for segment in segments:
                    if isinstance(segment, quant.Blocks):
                        layout += [-1, segment.id]
                    elif isinstance(segment, quant.Dense):
                        layout.append(0)
                        tensors.append(segment.weight)
                    else:
                        layout.append(len(segment.terms()))
                        tensors += [t for term in segment.terms() for t in (term.packed, term.scales)]
                biases.append(linear.bias if linear.bias is not None else torch.empty(0))
                crossovers.append(min(linear.crossover, 1 << 62) if linear.quant is not None else 0)
        style = (GEMMA_NORMS if decoder.gemma_norms else 0) | (GELU if decoder.gelu else 0)
        self.id = torch.ops.chat_native.keep(norms, tensors, layout, biases, crossovers, kinds, s.heads, s.kv_heads,
                                             s.head_dim, s.eps, s.window, style)
        weakref.finalize(self, torch.ops.chat_native.forget, self.id)

    def __call__(self, embedded: torch.Tensor, kv: KVBuffer, cos: torch.Tensor, sin: torch.Tensor,
                 local: tuple[torch.Tensor, torch.Tensor] | None = None,
                 counts: list[int] | None = None) -> torch.Tensor:
        """``embedded``: (rows x columns, hidden), a row's columns together; ``cos``/``sin``: (rows, columns,
        1, rotary dim), as ``Decoder._rope`` gives them (``local``: the windowed layers' own). Keys and values go
        to columns ``kv.length`` on; each row attends from its first column (a lone row: from ``kv.start``; a
        windowed layer: from the window's first), each column up to itself. ``counts``: each row's own number of
        columns (drafts beyond one row), ``embedded``'s rows a row's columns together, row after row."""
        if kv.n == 1:
            starts = torch.tensor([kv.start])
        else:
            starts = torch.tensor(kv.row_starts(1)).add_(kv.start)
        dim = cos.shape[-1]
        local_cos, local_sin = (t.reshape(-1, dim) for t in local) if local is not None else (torch.empty(0),) * 2
        if counts is not None:
            return torch.ops.chat_native.decode_ragged(self.id, embedded, kv.keys, kv.values, starts, kv.length,
                                                       torch.tensor(counts), cos.reshape(-1, dim), sin.reshape(-1, dim),
                                                       local_cos, local_sin)
        return torch.ops.chat_native.decode(self.id, embedded, kv.keys, kv.values, starts, kv.length,
                                            cos.reshape(-1, dim), sin.reshape(-1, dim), local_cos, local_sin)


def shift(kv: KVBuffer, moves: list[tuple[int, int, int, int]]) -> None:
    """Move columns of rows right in every layer of ``kv``: (row, first, last, by) each (``KVBuffer.settle``); a
    windowed layer's ring turns its slots."""
    rows, firsts, lasts, by = (list(x) for x in zip(*moves))
    torch.ops.chat_native.shift(kv.keys, kv.values, list(kv.ring), rows, firsts, lasts, by)


def sample(logits: torch.Tensor, params: list, u: torch.Tensor) -> list[int]:
    """``sampling.sample``'s draw for every row in one C++ call, given each sampled row's uniform
    number ``u``: the same filters and order (equal weights by token id); its sums run in another order than
    torch's, so a draw within rounding of the border between two tokens may take the neighbour."""
    return torch.ops.chat_native.sample(
        logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k or 0 for p in params]),
        torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p or 0.0 for p in params]), u).tolist()


def agrees(decoder: Decoder, step: Step) -> bool:
    """The C++ step's next-token logits match the eager step's on a fixed input (two rows, one left-padded):
    the same top token per row and a cosine above ``NEAR``; or, where they part by more, by no more than rounding.

    Both steps round to bf16 between operations, the same roundings; but a float32 sum (attention's, in another
    order than torch's) that lands within a few of its last bits of the midpoint between two bf16 values rounds
    one way in torch and the other here, and a deep model of random weights carries that one step through every
    later layer (the Phi-3.5-mini shape file: two of layer 0's attention outputs one bf16 step apart, every
    layer bit for bit torch's from the same input, logits 0.9987 apart). So both are then measured against the
    step with float32 activations (``Decoder.widened``): the C++ step agrees if it is no farther from that than
    ``ROUNDING`` times torch's own distance (its top token then as good as torch's: a near tie may go either way)."""
    ids = torch.arange(3, 3 + 2 * 9).remainder(decoder.shape.vocab).view(2, 9)
    eager, mine = _next_logits(decoder, ids, False), _next_logits(decoder, ids, step)
    cosine = torch.nn.functional.cosine_similarity(eager, mine, dim=-1)
    if bool((eager.argmax(-1) == mine.argmax(-1)).all()) and bool((cosine > NEAR).all()):
        return True
    exact = _next_logits(decoder.widened(), ids, False)
    theirs, ours = (torch.linalg.vector_norm(x - exact, dim=-1) / torch.linalg.vector_norm(exact, dim=-1)
                    for x in (eager, mine))
    ok = bool((ours <= ROUNDING * theirs).all())
    said = (f"cosine {[round(float(c), 5) for c in cosine]}; from float32 activations: torch's "
            f"{[round(float(d), 4) for d in theirs]}, the C++ step's {[round(float(d), 4) for d in ours]}")
    if ok:
        log.info("the C++ decode step parts from torch's by rounding, no more than torch's own (%s)", said)
    else:
        log.warning("the C++ decode step disagrees with torch's (%s): decode steps stay on torch ops", said)
    return ok


def _next_logits(decoder: Decoder, ids: torch.Tensor, native: Step | Literal[False]) -> torch.Tensor:
    """``agrees``' input: both rows prefilled on torch ops (the second left-padded by 3), then their next
    column's logits from a decode step (``native``: the C++ step, or False: torch's)."""
    kv = decoder.cache(2, 16)
    real = torch.ones(2, 9, dtype=kv.mask.dtype)
    real[1, :3] = 0  # the second row left-padded by 3
    kv.open(9, real)
    positions = (real.cumsum(1) - 1).clamp(min=0)
    decoder.forward(ids, kv, positions)
    kv.advance(9)
    kv.open(1)
    return decoder.forward(ids[:, -1:], kv, positions[:, -1:] + 1, native=native)


def columns_agree(decoder: Decoder, columns: int) -> bool:
    """A step of ``columns`` columns of one row (``Decoder.verify``) gives each column's logits bit for bit as
    that many single steps do, on a fixed input: drafted tokens are then checked exactly as the answer
    would have made them."""
    ids = torch.arange(5, 5 + 9 + columns).remainder(decoder.shape.vocab)[None]
    kv = decoder.cache(1, 16 + columns)
    kv.open(9)
    decoder.forward(ids[:, :9], kv, torch.arange(9)[None])
    kv.advance(9)
    kv.open(columns)
    wide = decoder.verify(ids[:, 9:], kv, torch.arange(9, 9 + columns)[None])
    single = []
    for j in range(columns):
        kv.open(1)
        single.append(decoder.forward(ids[:, 9 + j:10 + j], kv, torch.tensor([[9 + j]]))[0])
        kv.advance(1)
    ok = bool(torch.equal(wide, torch.stack(single)))
    if not ok:
        log.warning("a C++ step of %d columns differs from single steps here: no drafted tokens", columns)
    return ok


def rows_agree(decoder: Decoder, counts: tuple[int, ...] = (3, 1, 5)) -> bool:
    """A step of several rows, each its own number of columns (``Decoder.verify_rows``: drafts beyond one row),
    gives each column's logits bit for bit as single steps of that row alone do, on a fixed input (rows of different
    lengths, so left-padded), and leaves each row's keys and values the same once ``KVBuffer.settle`` keeps them."""
    lengths = [9 + 2 * r for r in range(len(counts))]
    ids = [torch.arange(5 + r, 5 + r + n + c).remainder(decoder.shape.vocab).tolist()
           for r, (n, c) in enumerate(zip(lengths, counts))]
    kv = decoder.cache(len(counts), 32 + max(counts) + max(lengths))
    kv.n = 0  # rows added one by one
    alone = []
    for r, (n, c) in enumerate(zip(lengths, counts)):
        one = decoder.cache(1, 32 + n + c)
        one.open(n)
        decoder.forward(torch.tensor([ids[r][:n]]), one, torch.arange(n)[None])
        one.advance(n)
        kv.add_row(*one.row(0))
        single = []
        for j in range(c):
            one.open(1)
            single.append(decoder.forward(torch.tensor([[ids[r][n + j]]]), one, torch.tensor([[n + j]]))[0])
            one.advance(1)
        alone.append((torch.stack(single), one.row(0)))
    wide = decoder.verify_rows([ids[r][n:] for r, n in enumerate(lengths)], kv, lengths)
    kv.settle(list(counts), max(counts), shift)
    ok, at = True, 0
    for r, c in enumerate(counts):
        keys, values = kv.row(r)
        ok = ok and torch.equal(wide[at:at + c], alone[r][0]) and all(
            torch.equal(a, b) for a, b in zip(keys + values, alone[r][1][0] + alone[r][1][1]))
        at += c
    if not ok:
        log.warning("a C++ step of several rows' drafts differs from single steps here: drafts for one row at a time")
    return ok


def use(decoder: Decoder) -> None:
    """Give ``decoder`` the C++ step (the library loaded) once it agrees with the eager step."""
    try:
        step = Step(decoder)
        ok = agrees(decoder, step)
    except RuntimeError as exc:  # a shape it does not cover (head size not a multiple of 16, ...)
        log.warning("the C++ decode step does not run this model (%s): decode steps stay on torch ops", exc)
        return
    if ok:
        decoder.native = step
        log.info("decode steps run in C++ (%s)", ", ".join(sorted(Path(p).name for p in loaded_paths())))


def attach(decoder: Decoder, cache_dir: str | Path, cpu: Cpu | None = None) -> Generator[None, None, None]:
    """Build (or find) the library, check it, and give ``decoder`` the C++ step; yields while building."""
    if (yield from library(cache_dir, cpu)):
        use(decoder)
