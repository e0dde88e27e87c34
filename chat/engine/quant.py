"""The engine's products (kernels room): which kernel multiplies each matrix, on which CPU class.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` (a private op: torch is pinned)
multiplies bf16 activations by 4-bit weights in groups of 32 along the input,
each group with its own scale and zero: w = (q - 8) * scale + zero. Every GGUF
block type of the form w = s * q + z per 32 weights (``gguf.affine``) goes there
exactly, but for s and z rounded to bf16: 4-bit types as one product (``Int4``),
5- to 8-bit ones as two summed (``Sum``). Types it cannot take stay dense
(``Dense``, a part of a ``Concat`` when a fused product mixes forms).

The int4 kernel reads a quarter of the bytes, which is what a decode step at a
few rows waits for; at many rows (a long prefill) it does the arithmetic slower
than a dense bf16 matmul on a CPU with native bf16. There a ``Linear`` holds both
and picks per call by its number of rows, against a crossover measured at
start-up (``calibrate``). Elsewhere dense bf16 is the slow one: ``POLICY``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from typing import Union

from . import gguf

log = logging.getLogger(__name__)

GROUP = gguf.BLOCK

# What each CPU class (``cpu.py``) keeps besides the int4 weights under CHAT_QUANT=auto, from products
# measured with torch 2.13 at 2 threads (µs; M rows; the int4 kernel with bf16 inputs):
#
# | class       | product    | M  | fp32 dense | bf16 dense | int4  |
# |-------------|------------|----|------------|------------|-------|
# | avx512_bf16 | 576->1536  | 1  | 96         | 110        | 64    |
# | avx512_bf16 | 576->1536  | 64 | 900        | 385        | 1026  |
# | avx512_bf16 | 576->49152 | 1  | 9,923      | 4,159      | 1,709 |
# | avx2        | 576->1536  | 1  | 132        | 139        | 75    |
# | avx2        | 576->1536  | 8  | 328        | 939        | 335   |
# | avx2        | 576->49152 | 8  | 33,465     | 30,827     | 11,136|
#
# With native bf16, dense bf16 beats int4 past ~16 rows (prefill): dense copies, picked by a measured
# crossover. Without it, dense bf16 is ~3x slower than fp32 at 8+ rows and int4 is on par with fp32 at
# many rows and far ahead at few: int4 alone (a float32 dense copy would quadruple the memory for no gain).
# ``generic`` (no AVX2, or not x86) has only the kernel's reference path: dense float32 weights.
POLICY = {"avx512_bf16": "int4 + dense bf16 copies", "avx512": "int4", "avx2": "int4", "generic": "dense float32"}


def dense_copies(isa: str) -> bool:
    """Whether ``CHAT_QUANT=auto`` keeps dense copies of the int4 products on this CPU class."""
    return isa == "avx512_bf16"


def quantized(isa: str) -> bool:
    """Whether this CPU class runs the int4 kernel at all."""
    return isa != "generic"


_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu


class Int4:
    """A packed 4-bit matrix (out, in): the kernel's weight and its (groups, out, 2) scales and zeros,
    w = (q - 8) * scale + zero."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.out_features, self.in_features = q.shape
        self.packed = _pack(q.to(torch.int32).contiguous(), 1)
        self.scales = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(x, self.packed, GROUP, self.scales)

    def terms(self) -> list["Int4"]:
        return [self]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * 2


class Sum:
    """Weights of 5 to 8 bits as two int4 products, summed: q = 16 h + l with 4-bit h and l, so
    s * q + z = (h - 8) * 16 s + (l - 8) * s + (136 s + z). Exact but for s and the zeros in bf16 (as
    for 4-bit weights): the high product's zero is 0 or 128 s, both exact in bf16, whichever leaves the
    low product's zero the smaller; a symmetric type's zero (z = -2^(bits-1) s: Q5_0, Q8_0) follows the
    scale's rounding, so a weight's error stays (s - bf16(s)) times its distance from the centre."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int = 8) -> None:
        centre = float(1 << (bits - 1))
        rounded = s.to(torch.bfloat16).float()
        z = torch.where(z == -centre * s, -centre * rounded, z)
        s = rounded
        total = 136 * s + z
        high_zero = torch.where((total - 128 * s).abs() < total.abs(), 128 * s, torch.zeros_like(s))
        self.high = Int4(q >> 4, 16 * s, high_zero)
        self.low = Int4(q & 15, s, total - high_zero)
        self.out_features, self.in_features = q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(x).add_(self.low(x))

    def terms(self) -> list[Int4]:
        return [self.high, self.low]

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes


def from_affine(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> Int4 | Sum:
    """The int4 kernel's form of weights w = s * q + z (``gguf.affine``): one product for 4 bits, two above."""
    return Int4(q, s, z + 8 * s) if bits == 4 else Sum(q, s, z, bits)


class Dense:
    """A dense part of a product whose other parts are int4 (a type the int4 kernel cannot take)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Concat:
    """A fused product (q/k/v, gate/up) whose parts are stored in different forms: their outputs side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Product = Union["Int4", "Sum", "Dense", "Concat"]  # what a Linear's quantized side may be


def parts(product: Product) -> list:
    """A product's parts side by side (one, unless it is a ``Concat``)."""
    return product.parts if isinstance(product, Concat) else [product]


class Linear:
    """y = x W^T (+ b) for 2-D bf16 ``x``: int4 for decode steps of at most ``crossover`` rows,
    else dense.

    Either may be missing (dense-only models; int4-only to save memory). With both, ``crossover``
    is measured (``calibrate``); until then decode steps take int4. A seeded answer is the same
    alone or in a batch as long as the batch stays within the crossover.
    """

    ALWAYS = 1 << 30

    def __init__(self, dense: torch.Tensor | None = None, quant: Product | None = None,
                 bias: torch.Tensor | None = None) -> None:
        if dense is None and quant is None:
            raise ValueError("a Linear needs weights")
        self.dense, self.quant, self.bias = dense, quant, bias
        self.crossover = self.ALWAYS if quant is not None else 0

    @property
    def out_features(self) -> int:
        if self.dense is not None:
            return self.dense.shape[0]
        assert self.quant is not None
        return self.quant.out_features

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


def _seconds(fn: Callable[[Linear, torch.Tensor], torch.Tensor], linears: list, x: torch.Tensor, reps: int) -> float:
    """Best of ``reps`` passes of ``fn`` over every Linear, each pass one product per Linear: the
    weights come from memory, as they do in a forward (one Linear alone stays in the cache)."""
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms the kernels up
        started = time.perf_counter()
        for linear in linears:
            fn(linear, x)
        best = min(best, time.perf_counter() - started)
    return best


def _dense_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    assert linear.dense is not None
    return F.linear(x, linear.dense)


def _quant_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    assert linear.quant is not None
    return linear.quant(x)


def crossover(linears: list[Linear], rows: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
              reps: int = 2) -> int:
    """The most rows at which the int4 products of ``linears`` (all of one shape, each with both
    weights) are still faster than the dense ones, measured; 0 when int4 never wins."""
    best = 0
    shape = linears[0].dense
    assert shape is not None
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, shape.shape[1], dtype=shape.dtype)
            dense = _seconds(_dense_product, linears, x, reps)
            int4 = _seconds(_quant_product, linears, x, reps)
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
