"""The engine's matrices: dense bfloat16, or 4-bit groups on torch's int4 CPU kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` (a private op: torch is pinned)
multiplies bf16 activations by 4-bit weights in groups of 32 along the input,
each group with its own scale and zero: w = (q - 8) * scale + zero. GGUF's
Q4_0 and Q4_1 blocks are exactly that (``gguf.int4_parts``), so their q values
go to the kernel unchanged; only scale and zero are rounded to bf16.

The int4 kernel reads a quarter of the bytes, which is what a decode step at a
few rows waits for; at many rows (a long prefill) it does the arithmetic far
slower than the dense bf16 matmul. A ``Linear`` holding both picks per call by
its number of rows, against a crossover measured at start-up (``calibrate``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from . import gguf

log = logging.getLogger(__name__)

GROUP = gguf.BLOCK
_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu


def supported() -> bool:
    """The int4 CPU kernel exists in this torch."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class Int4:
    """A packed 4-bit matrix (out, in): the kernel's weight and its (groups, out, 2) scales and zeros."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        self.out_features, self.in_features = q.shape
        self.packed = _pack(q.to(torch.int32).contiguous(), 1)
        self.scales = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(x, self.packed, GROUP, self.scales)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * 2


def stack_int4(parts: list[tuple]) -> Int4:
    """One Int4 of several (q, scale, zero) matrices stacked along their outputs (fused q/k/v, gate/up)."""
    return Int4(*(torch.cat(p) for p in zip(*parts)))


class Int8Pair:
    """A Q8_0 matrix on the int4 kernel, exactly: q + 128 = 16 h + l with 4-bit h and l, so
    d * q = (h - 8) * 16d + (l - 8) * d + 8d: two int4 products, summed."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        biased = q.to(torch.int16) + 128
        high, low = (biased >> 4).to(torch.uint8), (biased & 15).to(torch.uint8)
        self.out_features, self.in_features = q.shape
        self.high = Int4(high, 16 * d, torch.zeros_like(d))
        self.low = Int4(low, d, 8 * d)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(x).add_(self.low(x))

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes


class Linear:
    """y = x W^T (+ b) for 2-D bf16 ``x``: int4 for decode steps of at most ``crossover`` rows,
    else dense.

    Either may be missing (dense-only models; int4-only to save memory). With both, ``crossover``
    is measured (``calibrate``); until then decode steps take int4. A seeded answer is the same
    alone or in a batch as long as the batch stays within the crossover.
    """

    ALWAYS = 1 << 30

    def __init__(self, dense: torch.Tensor | None = None, quant=None, bias: torch.Tensor | None = None):
        if dense is None and quant is None:
            raise ValueError("a Linear needs weights")
        self.dense, self.quant, self.bias = dense, quant, bias
        self.crossover = self.ALWAYS if quant is not None else 0

    @property
    def out_features(self) -> int:
        return self.dense.shape[0] if self.dense is not None else self.quant.out_features

    def __call__(self, x: torch.Tensor, decode: bool = True) -> torch.Tensor:
        """``decode``: a decode step's product (one row per answer). Prefill products take the
        dense weights whenever there are some, so a prompt's arithmetic does not depend on who
        it is prefilled with; decode steps take int4 up to ``crossover`` rows."""
        if self.quant is not None and (self.dense is None or decode and x.shape[0] <= self.crossover):
            y = self.quant(x)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.dense, self.bias)

    @property
    def nbytes(self) -> int:
        dense = self.dense.numel() * self.dense.element_size() if self.dense is not None else 0
        return dense + (self.quant.nbytes if self.quant is not None else 0)


def _seconds(fn, linears: list, x: torch.Tensor, reps: int) -> float:
    """Best of ``reps`` passes of ``fn`` over every Linear, each pass one product per Linear: the
    weights come from memory, as they do in a forward (one Linear alone stays in the cache)."""
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms the kernels up
        started = time.perf_counter()
        for linear in linears:
            fn(linear, x)
        best = min(best, time.perf_counter() - started)
    return best


def crossover(linears: list[Linear], rows=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), reps: int = 2) -> int:
    """The most rows at which the int4 products of ``linears`` (all of one shape, each with both
    weights) are still faster than the dense ones, measured; 0 when int4 never wins."""
    best = 0
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, linears[0].dense.shape[1], dtype=linears[0].dense.dtype)
            dense = _seconds(lambda lin, t: F.linear(t, lin.dense), linears, x, reps)
            int4 = _seconds(lambda lin, t: lin.quant(t), linears, x, reps)
            if int4 < dense:
                best = m
            elif m > 2 * max(best, 4):
                break  # dense has won at twice the rows int4 last won at: it only gets further ahead
    return best


def by_shape(linears: list[Linear]) -> dict:
    """The Linears that have both int4 and dense weights, by shape ("OUTxIN"): each shape's share one
    crossover."""
    groups: dict = {}
    for linear in linears:
        if linear.dense is not None and linear.quant is not None:
            groups.setdefault("x".join(map(str, linear.dense.shape)), []).append(linear)
    return groups


def calibrate(linears: list[Linear], known: dict | None = None) -> Iterator[tuple[str, int]]:
    """Give every Linear that has both int4 and dense weights the crossover of its shape: from
    ``known`` ({"OUTxIN": rows}, an earlier measurement), else measured (``crossover``, a second or
    so a shape). Yields (shape, rows) as each shape is done, so a caller can do other work between."""
    for key, group in by_shape(linears).items():
        rows = (known or {}).get(key)
        if rows is None:
            rows = crossover(group)
        for linear in group:
            linear.crossover = rows
        yield key, rows
