"""The GGUF tensor types the engine reads: one entry each, the one table to extend for a new type.

An entry says how the type is laid out (weights and bytes a block: how the file is walked), how it is
decoded (a float type; ``affine``: w = s·q + z per 32 weights with q of ``bits`` bits, ``gguf.affine``;
``signed``: w = s·q with signed q, ``gguf.signed``; otherwise gguf-py dequantizes it to a dense part), which
products take it (the int4 kernel takes the affine types: one product for 4 bits, two summed for 5 to 8; the
C++ block products take affine and signed types in the form ``product`` names, whose id the C++ library knows
as ``quant.Blocks.FORMS``) and whether its bytes move to the block products as stored (``gguf.regroup``; the
K-quants by the C++ library's ``blocks_repack_k``) rather than from their decoded parts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockType:
    id: int  # GGUF's ggml_type
    name: str
    per_block: int  # weights a block (1 for a float type)
    block_bytes: int  # bytes a block
    float: bool = False  # F32, F16, BF16: read as numbers
    bits: int | None = None  # affine: w = s * q + z per 32 weights with q of this many bits (``gguf.affine``)
    signed: bool = False  # w = s * q with signed q (``gguf.signed``)
    stored: bool = False  # moved to the block products as stored (``gguf.regroup``), not decoded
    product: str | None = None  # the block products' form: "q4", "q5", "q6", "q8" (None: dense)


TYPES = {t.id: t for t in (
    BlockType(0, "F32", 1, 4, float=True),
    BlockType(1, "F16", 1, 2, float=True),
    BlockType(30, "BF16", 1, 2, float=True),
    BlockType(2, "Q4_0", 32, 18, bits=4, stored=True, product="q4"),
    BlockType(3, "Q4_1", 32, 20, bits=4, stored=True, product="q4"),
    BlockType(6, "Q5_0", 32, 22, bits=5, stored=True, product="q5"),
    BlockType(7, "Q5_1", 32, 24, bits=5, stored=True, product="q5"),
    BlockType(8, "Q8_0", 32, 34, bits=8, signed=True, stored=True, product="q8"),
    BlockType(12, "Q4_K", 256, 144, bits=4, stored=True, product="q4"),
    BlockType(13, "Q5_K", 256, 176, bits=5, stored=True, product="q5"),
    BlockType(14, "Q6_K", 256, 210, signed=True, stored=True, product="q6"),
    BlockType(10, "Q2_K", 256, 84),
    BlockType(11, "Q3_K", 256, 110),
)}
