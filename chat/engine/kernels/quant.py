"""The engine's products (kernels room): which kernel multiplies each matrix, on which CPU class.

``Blocks``: the C++ library's block products (``blocks.cpp``), the file's blocks as stored times 8-bit
activations, llama.cpp's arithmetic: what a GGUF's quantized products run on once the library is built
(no dense copies beside them). Until then, and without a compiler:

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
start-up (``crossover.calibrate``). Elsewhere dense bf16 is the slow one: ``POLICY``.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from . import gguf

log = logging.getLogger(__name__)

GROUP = gguf.BLOCK

# What each CPU class (``cpu.py``) keeps besides the quantized weights under CHAT_QUANT=auto, from products
# measured with torch 2.13 at 2 threads (µs; M rows; the int4 kernel with bf16 inputs; ``Blocks``: the C++
# library's blocks with 8-bit activations, Q4_1):
#
# | class       | product    | M  | fp32 dense | bf16 dense | int4  | blocks |
# |-------------|------------|----|------------|------------|-------|--------|
# | avx512_bf16 | 576->1536  | 1  | 96         | 56-70      | 64    | 32-52  |
# | avx512_bf16 | 576->1536  | 8  |            | 82-95      |       | 123-131|
# | avx512_bf16 | 576->1536  | 64 | 900        | 302-385    | 1026  | 998    |
# | avx512_bf16 | 576->49152 | 1  | 9,923      | 4,159      | 1,709 |        |
# | avx2        | 576->1536  | 1  | 132        | 139        | 75    |        |
# | avx2        | 576->1536  | 8  | 328        | 939        | 335   |        |
# | avx2        | 576->49152 | 8  | 33,465     | 30,827     | 11,136|        |
#
# With native bf16, dense bf16 beats int4 past ~16 rows (prefill): dense copies, picked by a measured
# crossover, when the products are on the int4 kernel. On the block products they are not kept: a decode
# step of one row is twice as fast as dense there, and a 0.5B model's copies would be 1 GB (prefill of
# many rows pays ~3x; the whole model stays within 1.5x its file). Without native bf16, dense bf16 is ~3x
# slower than fp32 at 8+ rows and int4 is on par with fp32 at many rows and far ahead at few: int4 alone (a
# float32 dense copy would quadruple the memory for no gain). ``generic`` (no AVX2, or not x86) has only
# the kernel's reference path: dense float32 weights.
@dataclass(frozen=True)
class Policy:
    """What ``CHAT_QUANT=auto`` runs on one CPU class: read by the loader (``dense_copies``, ``quantized``)."""

    quantized: bool  # quantized products at all (the int4 kernel, then the block products); else dense float32
    int4_dense_copies: bool  # dense bf16 copies beside the int4 products, for prefills (never beside blocks)

    def __str__(self) -> str:
        if not self.quantized:
            return "dense float32"
        return "int4 + dense bf16 copies, or blocks alone" if self.int4_dense_copies else "int4 or blocks"


POLICY = {"avx512_bf16": Policy(quantized=True, int4_dense_copies=True),
          "avx512": Policy(quantized=True, int4_dense_copies=False),
          "avx2": Policy(quantized=True, int4_dense_copies=False),
          "generic": Policy(quantized=False, int4_dense_copies=False)}


def dense_copies(isa: str, blocks: bool = False) -> bool:
    """Whether ``CHAT_QUANT=auto`` keeps dense copies of the quantized products on this CPU class (``blocks``:
    the products are the C++ library's blocks, which never keep them)."""
    return POLICY[isa].int4_dense_copies and not blocks


def quantized(isa: str) -> bool:
    """Whether this CPU class runs quantized products at all."""
    return POLICY[isa].quantized


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


def unsigned_bytes() -> bool:
    """Whether 8-bit blocks are kept as q + 128 (``Blocks.U8``: the library was built with VNNI, whose dot
    product takes unsigned bytes at full range; else signed, with AVX2's sign trick)."""
    global _UNSIGNED
    if _UNSIGNED is None:
        _UNSIGNED = bool(torch.ops.chat_native.blocks_vnni())
    return _UNSIGNED


_UNSIGNED: bool | None = None


def by_group(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(out, n) -> (groups, n, ``rows``): each column's values of a group of rows side by side (zero-padded)."""
    groups = -(-t.shape[0] // rows)
    return F.pad(t, (0, 0, 0, groups * rows - t.shape[0])).reshape(groups, rows, -1).transpose(1, 2).contiguous()


class Blocks:
    """A matrix (out, in) kept as blocks of 32 weights for the C++ library's product with 8-bit activations
    (``blocks.cpp``; it must be loaded: ``build.load``): 4-bit weights as nibbles (``U4``), 5-bit ones with
    a plane of fifth bits (``U5``), 8-bit ones signed (``S8``; two scales a block for Q6_K's 16-weight
    sub-blocks), each block with its scale and, unless the type is symmetric, its min: w = s * q + z, the
    file's numbers unchanged (scales and mins in f16 where they are exactly f16, else float32). Rows go in
    groups of 8, each block's bytes interleaved 4 by 4 across the group (``blocks.cpp`` draws it)."""

    U4, U5, S8, U8, U6 = 0, 1, 2, 3, 4  # the C++ library's ids of the forms
    KINDS = {U4: "q4", U5: "q5", S8: "q8", U8: "q8", U6: "q6"}
    FORMS = {"q4": U4, "q5": U5, "q8": S8, "q6": U6}  # a block type's ``product`` (blocktypes.py) -> its form
    SIX = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8)  # U6: a high-bits plane's shift of [chunk % 2][half]
    ROWS = 8  # rows a group

    def __init__(self, kind: int, rows: int, qs: torch.Tensor, qh: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, centre: float = 0.0, sub: int = 1, supers: tuple | None = None) -> None:
        """The stored form: ``qs`` (groups, blocks, bytes) u8, ``qh`` the U5 fifth bits (groups, blocks, 32),
        ``scales`` (groups, blocks * sub, 8) and ``mins`` (groups, blocks, 8, or empty: z = -centre * s),
        f16 or float32 (see ``from_parts``, ``gguf.regroup``); or with ``supers`` (blocks a super-block, d,
        dmin: (groups, super-blocks, 8) f16, dmin None for the 8-bit kinds), a K-quant's bytes: s = d * scales,
        z = -(dmin * mins) (``from_k``)."""
        self.kind, self.qs, self.qh, self.scales, self.mins = kind, qs, qh, scales, mins
        self.centre, self.sub = centre, sub
        self.per_super, self.dsuper, self.msuper = supers or (0, None, None)
        self.out_features, self.in_features = rows, qs.shape[1] * GROUP
        empty = torch.empty(0, dtype=torch.float16)
        self.id = torch.ops.chat_native.blocks_keep(
            kind, rows, sub, centre, qs, qh, scales, mins, self.per_super,
            empty if self.dsuper is None else self.dsuper, empty if self.msuper is None else self.msuper)
        weakref.finalize(self, torch.ops.chat_native.blocks_forget, self.id)

    @classmethod
    def _packed(cls, q: torch.Tensor, bits: int, sub: int) -> tuple:
        """(kind, qs, qh, centre) of ``q`` (out, in): uint8 in 0 .. 2^bits - 1 (w = s * q + z), or for ``bits``
        8, int8 (w = s * q), ``sub`` scales a block."""
        rows, cols = q.shape
        nb = cols // GROUP
        groups = -(-rows // cls.ROWS)
        pad = groups * cls.ROWS - rows
        qh = torch.empty(0, dtype=torch.uint8)
        if bits == 8:
            kind = cls.U8 if sub == 1 and unsigned_bytes() else cls.S8
            stored = F.pad(q.view(torch.uint8), (0, 0, 0, pad))  # padding rows: q = 0
            stored = stored ^ 0x80 if kind == cls.U8 else stored  # q + 128
            # (groups, 8 rows, blocks, 8 chunks, 4) -> (groups, blocks, chunk, row, 4)
            grouped = stored.reshape(groups, cls.ROWS, nb, 8, 4)
            qs = grouped.permute(0, 2, 3, 1, 4).reshape(groups, nb, 256).contiguous()
            return kind, qs, qh, 128.0 if kind == cls.U8 else 0.0
        kind = {4: cls.U4, 5: cls.U5, 6: cls.U6}[bits]
        grouped = F.pad(q, (0, 0, 0, pad)).reshape(groups, cls.ROWS, nb, 2, 4, 4)  # half, chunk, 4
        low = grouped & 15
        packed = low[:, :, :, 0] | (low[:, :, :, 1] << 4)  # (groups, row, blocks, chunk, 4)
        qs = packed.permute(0, 2, 3, 1, 4).reshape(groups, nb, 128).contiguous()
        if bits == 5:  # byte 4 j + k, bit 2 c + half: row j's weight 4 c + k (+ 16 for the high half)
            fifth = (grouped >> 4).permute(0, 2, 4, 3, 1, 5).reshape(groups, nb, 8, 32)
            qh = (fifth << torch.arange(8, dtype=torch.uint8)[:, None]).sum(2, dtype=torch.uint8)
        if bits == 6:  # plane p, byte 4 j + k, bits 2 (2 c' + half): row j's weight 4 (2 p + c') + k's high 2 bits
            high = (grouped >> 4).reshape(groups, cls.ROWS, nb, 2, 2, 2, 4)  # (g, j, blocks, half, p, c', k)
            high = high.permute(0, 2, 4, 1, 6, 5, 3)  # (g, blocks, p, j, k, c', half)
            qh = (high << cls.SIX).sum((-2, -1), dtype=torch.uint8).reshape(groups, nb, 64)
        return kind, qs, qh, float(1 << (bits - 1))

    @classmethod
    def from_parts(cls, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, bits: int) -> "Blocks":
        """``q``: (out, in) uint8 in 0 .. 2^bits - 1 with w = s * q + z per 32 weights (``gguf.affine``), or
        for ``bits`` 8 with ``z`` None, int8 with w = s * q per 32 or 16 weights (``gguf.signed``)."""
        nb = q.shape[1] // GROUP
        centre = float(1 << (bits - 1))
        symmetric = z is None or bool((z == -centre * s).all())
        if bits == 8:
            if not symmetric:
                raise ValueError("8-bit blocks must be symmetric")
            q = q.to(torch.int8) if z is None else (q.to(torch.int16) - 128).to(torch.int8)
        kind, qs, qh, centre = cls._packed(q, bits, s.shape[1] // nb)
        mins = z if z is not None and not symmetric else torch.empty(0)
        exact = all(bool((t.half().float() == t).all()) for t in (s, mins))
        dtype = torch.float16 if exact else torch.float32
        scales = by_group(s.to(dtype), cls.ROWS)
        mins = by_group(mins.to(dtype), cls.ROWS) if mins.numel() else mins.to(dtype)
        return cls(kind, q.shape[0], qs, qh, scales, mins, centre if symmetric and kind != cls.S8 else 0.0,
                   s.shape[1] // nb)

    @classmethod
    def from_k(cls, q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor,
               dmin: torch.Tensor | None, bits: int) -> "Blocks":
        """A K-quant's parts (``gguf.k_parts``: Q4_K and Q5_K with ``bits`` 4 and 5, Q6_K with 6, two scales a
        block) kept as the file has them: byte scales and mins, an f16 d and dmin a super-block."""
        nb = q.shape[1] // GROUP
        if bits == 6:
            q = (q + 32).view(torch.uint8)  # w = s * (q - 32)
        kind, qs, qh, _ = cls._packed(q, bits, sc.shape[1] // nb)
        supers = (nb // d.shape[1], by_group(d, cls.ROWS), None if dmin is None else by_group(dmin, cls.ROWS))
        mins = torch.empty(0, dtype=torch.uint8) if mn is None else by_group(mn, cls.ROWS)
        return cls(kind, q.shape[0], qs, qh, by_group(sc, cls.ROWS), mins, 32.0 if bits == 6 else 0.0,
                   sc.shape[1] // nb, supers)

    @classmethod
    def from_k_bytes(cls, rows: int, qs: torch.Tensor, qh: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                     d: torch.Tensor, dmin: torch.Tensor) -> "Blocks":
        """A K-quant's blocks as the C++ library moved them from the file's bytes (``blocks_repack_k``): the
        layout ``from_k`` builds."""
        six = sc.dtype == torch.int8
        return cls(cls.U6 if six else cls.U5 if qh.numel() else cls.U4, rows, qs, qh, sc, mn, 32.0 if six else 0.0,
                   2 if six else 1, (8, d, None if six else dmin))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.chat_native.blocks_mm(self.id, x)

    def dense(self) -> torch.Tensor:
        """The weights as float32 (out, in), w = s * q + z from what is stored (tests: nothing was lost)."""
        groups, nb = self.qs.shape[:2]
        rows, padded = self.out_features, groups * self.ROWS

        def by_row(t: torch.Tensor) -> torch.Tensor:  # (groups, blocks * sub, 8) -> (rows, blocks * sub)
            return t.float().transpose(1, 2).reshape(padded, -1)[:rows]
        s = by_row(self._scales())
        if self.kind in (self.S8, self.U8):
            q = self._signed().reshape(groups, nb, 8, self.ROWS, 4).permute(0, 3, 1, 2, 4)
            q = q.reshape(padded, nb * self.sub, -1)[:rows].float()
            return (s[..., None] * q).reshape(rows, -1)
        packed = self.qs.reshape(groups, nb, 4, self.ROWS, 4).permute(0, 3, 1, 2, 4)  # (groups, row, blocks, c, 4)
        if self.kind == self.U6:
            planes = self.qh.reshape(groups, nb, 2, self.ROWS, 4).permute(0, 3, 1, 2, 4)
            q6 = self._six(packed, planes).reshape(padded, nb * 2, GROUP // 2)[:rows].float()
            return ((q6 - self.centre) * s[..., None]).reshape(rows, -1)
        q = torch.stack([packed & 15, packed >> 4], dim=3)  # (groups, row, blocks, half, chunk, 4)
        if self.kind == self.U5:
            # (groups, blocks, 2 c + half, 4 j + k)
            bits = (self.qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
            bits = bits.reshape(groups, nb, 4, 2, self.ROWS, 4).permute(0, 4, 1, 3, 2, 5)
            q = q | (bits.to(torch.uint8) << 4)
        q = q.reshape(padded, nb, GROUP)[:rows].float()
        z = by_row(self._mins())[..., None] if self.mins.numel() else -self.centre * s[..., None]
        return (q * s[..., None] + z).reshape(rows, -1)

    def _scales(self, groups: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' scales as float32: (groups, blocks * sub, 8), or with ``groups`` and ``rows`` (ids' group
        and row in it) those rows' (ids, blocks * sub)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if groups is None else t[groups, :, rows]
        if not self.per_super:
            return pick(self.scales).float()
        assert self.dsuper is not None
        d = pick(self.dsuper).repeat_interleave(self.per_super * self.sub, dim=1)
        return d.float() * pick(self.scales).float()

    def _mins(self) -> torch.Tensor:
        """The blocks' mins as float32, (groups, blocks, 8)."""
        if not self.per_super:
            return self.mins.float()
        assert self.msuper is not None
        return -(self.msuper.repeat_interleave(self.per_super, dim=1).float() * self.mins.float())

    @classmethod
    def _six(cls, packed: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
        """U6's q in 0 .. 63, (..., half, chunk, 4), from its nibbles (..., chunk, 4) and planes (..., 2, 4)."""
        q = torch.stack([packed & 15, packed >> 4], dim=-3)
        high = (planes[..., :, None, None, :] >> cls.SIX[:, :, None]) & 3  # (..., p, c', half, k)
        return q | (high.movedim(-2, -4).reshape(*planes.shape[:-2], 2, 4, 4) << 4)

    def _signed(self) -> torch.Tensor:
        return (self.qs ^ 0x80 if self.kind == self.U8 else self.qs).view(torch.int8)

    @property
    def looked_up(self) -> bool:
        """A matrix whose rows ``lookup`` reads (Q8_0's bytes, Q6_K's 6 bits; a scale per 32 or 16 weights, no
        min): a tied token table's lookups read it."""
        return self.kind in (self.S8, self.U8, self.U6)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weights (``looked_up``), float32 (len(ids), in): a table's lookups read its blocks."""
        assert self.looked_up
        groups, nb = self.qs.shape[:2]
        g, j = ids // self.ROWS, ids % self.ROWS
        if self.kind == self.U6:
            packed = self.qs.reshape(groups, nb, 4, self.ROWS, 4)[g, :, :, j]  # (ids, blocks, chunk, 4)
            planes = self.qh.reshape(groups, nb, 2, self.ROWS, 4)[g, :, :, j]
            q6 = self._six(packed, planes).reshape(len(ids), nb * 2, GROUP // 2).float()
            return ((q6 - self.centre) * self._scales(g, j)[..., None]).reshape(len(ids), -1)
        q = self.qs.reshape(groups, nb, 8, self.ROWS, 4)[g, :, :, j]  # (ids, blocks, chunk, 4)
        q = (q ^ 0x80 if self.kind == self.U8 else q).view(torch.int8)
        s = self._scales(g, j)  # (ids, blocks * sub)
        return (q.reshape(len(ids), nb * self.sub, GROUP // self.sub).float() * s[..., None]).reshape(len(ids), -1)

    @property
    def form(self) -> str:
        return self.KINDS[self.kind]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.qh, self.scales, self.mins, self.dsuper,
                                                          self.msuper) if t is not None)


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


Product = Union["Int4", "Sum", "Blocks", "Dense", "Concat"]  # what a Linear's quantized side may be


def parts(product: Product) -> list:
    """A product's parts side by side (one, unless it is a ``Concat``)."""
    return product.parts if isinstance(product, Concat) else [product]


class Linear:
    """y = x W^T (+ b) for 2-D bf16 ``x``: int4 for decode steps of at most ``crossover`` rows,
    else dense.

    Either may be missing (dense-only models; int4-only to save memory). With both, ``crossover``
    is measured (``crossover.calibrate``); until then decode steps take int4. A seeded answer is the same
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
