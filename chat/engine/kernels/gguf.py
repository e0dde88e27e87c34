"""Reading a GGUF file: its metadata and its tensors as the file stores them.

The reader walks the header once (the vocabulary's tens of thousands of strings
are skipped, not decoded: the tokenizer is built by transformers) and maps the
tensor data, so nothing is read until a tensor is used. Quantized tensors are
handed out as their blocks' parts, which the engine feeds to its int4 kernel
unchanged (``quant.py``), or dequantized to floats where it needs dense weights.

Block layouts (llama.cpp's ggml-common.h), 32 weights a block:
``Q4_0`` d (f16), 16 bytes of 4-bit q: w = d * (q - 8);
``Q4_1`` d, m (f16), 16 bytes of q: w = d * q + m;
``Q5_0`` d, 4 bytes of fifth bits, 16 bytes of 4-bit q: w = d * (q - 16);
``Q5_1`` d, m, fifth bits, q: w = d * q + m;
``Q8_0`` d (f16), 32 signed bytes q: w = d * q.
In the 4- and 5-bit ones byte i holds weight i in its low nibble and weight i + 16 in its high one;
bit i of the fifth bits is weight i's. K-quants hold 256 weights a super-block in 8 sub-blocks of 32
(``Q4_K``, ``Q5_K``: w = d * sc * q - dmin * m, 6-bit sc and m per sub-block) or 16 of 16 (``Q6_K``).

``affine`` gives every type whose weights are w = s * q + z with one s and z per 32 weights (all of
the above but Q6_K) as q, s and z, computed as gguf-py computes the weights, so
``s * q + z`` is bit for bit gguf-py's dequantization: those go to the int4 kernel.
"""
from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .blocktypes import TYPES

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
BLOCK = 32
_FLOAT = {F32: np.float32, F16: np.float16}
# Views of the one table (blocktypes.TYPES) that the code here and the loader read.
NAMES = {k: t.name for k, t in TYPES.items()}
AFFINE = tuple(k for k, t in TYPES.items() if t.bits)  # w = s * q + z per 32 weights: see ``affine``
BITS = {k: t.bits for k, t in TYPES.items() if t.bits}


def type_name(kind: int) -> str:
    return NAMES.get(kind, f"type {kind}")

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Tensor:
    """One tensor: ``shape`` in torch order (rows, columns), ``raw`` its bytes (a read-only map)."""

    name: str
    shape: tuple[int, ...]
    kind: int
    raw: np.ndarray

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    def blocks(self) -> np.ndarray:
        """(rows, blocks per row, bytes per block) of a block-quantized tensor."""
        size = TYPES[self.kind].block_bytes
        return self.raw.reshape(self.rows, -1, size)


def rows(t: Tensor, begin: int, end: int) -> Tensor:
    """Rows [begin, end) of a 2-D tensor (its bytes a slice of the map: rows are stored one after another)."""
    size = t.raw.nbytes // t.rows
    return Tensor(t.name, (end - begin, *t.shape[1:]), t.kind, t.raw[begin * size:end * size])


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def meta(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read(path: str | Path) -> GGUFFile:
    """The file's metadata (string arrays as their length) and its tensors, mapped, not read."""
    path = Path(path)
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    blob = mapped.data  # the header, read through struct (a memoryview of the map)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_meta = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos, metadata = 24, {}
    for _ in range(n_meta):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind)
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, shape, kind, offset))
    align = metadata.get("general.alignment", 32)
    data = (pos + align - 1) // align * align
    tensors = {}
    for name, shape, kind, offset in infos:
        start = data + offset
        tensors[name] = Tensor(name, shape, kind, mapped[start:start + _nbytes(kind, shape, path)])
    return GGUFFile(path, metadata, tensors)


def _nbytes(kind: int, shape: tuple, path: Path) -> int:
    count = int(np.prod(shape))
    if kind not in TYPES:
        raise ValueError(f"{path}: tensor type {kind} is not supported")
    return count // TYPES[kind].per_block * TYPES[kind].block_bytes


def _string(blob: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8", "replace"), pos + 8 + length


def _value(blob: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALAR:
        fmt = _SCALAR[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"GGUF metadata value of type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _SCALAR:
        fmt = _SCALAR[item]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * struct.calcsize(fmt)
    if item != _STRING:
        raise ValueError(f"GGUF metadata array of type {item}")
    for _ in range(count):  # the vocabulary and merges: the tokenizer reads them, not the engine
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos


# ---- block contents, as torch tensors (vectorized and multi-threaded: the whole model in a second)


def _blocks(t: Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(t.blocks()))  # a copy: the map is read-only


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of every block, as float32 (rows, blocks)."""
    return blocks[:, :, at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> its 32 4-bit values in weight order, (rows, blocks * 32) uint8."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(qs.shape[0], -1)


def int8_parts(t: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor as (q (rows, cols) int8, d (rows, cols / 32) float32): w = d * q."""
    blocks = _blocks(t)
    return blocks[:, :, 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1), _halves(blocks, 0)


def dequantize(t: Tensor) -> torch.Tensor:
    """The tensor as float32 (rows, cols), each weight bit for bit as gguf-py computes it."""
    if t.kind in _FLOAT:
        return torch.from_numpy(np.array(t.raw.view(_FLOAT[t.kind]), dtype=np.float32)).reshape(t.rows, -1)
    if t.kind == BF16:
        return torch.from_numpy(np.array(t.raw)).view(torch.bfloat16).float().reshape(t.rows, -1)
    if t.kind in AFFINE:
        q, s, z = affine(t)
        return (q.reshape(t.rows, -1, BLOCK).float() * s[..., None] + z[..., None]).reshape(t.rows, -1)
    if t.kind == Q6_K:
        q, s = signed(t)
        return (s[..., None] * q.reshape(t.rows, s.shape[1], -1).float()).reshape(t.rows, -1)
    from gguf import GGMLQuantizationType, quants  # the other block types (Q6_K, Q2_K, Q3_K)
    dense = quants.dequantize(np.asarray(t.raw), GGMLQuantizationType(t.kind)).reshape(t.rows, -1)
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))


def copied(t: Tensor) -> Tensor:
    """The tensor with its bytes copied out of the file's map (which then need not stay mapped: a map kept
    open holds every page loading read in the process's resident memory)."""
    return Tensor(t.name, t.shape, t.kind, np.array(t.raw))


def lookup(t: Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a block-quantized (rows, cols) tensor as float32 (``ids``' shape + (cols,)), each as
    ``dequantize`` gives it: an embedding table stays the file's bytes, only the rows asked for are read.
    gguf-py's own numpy code (what ``dequantize`` matches bit for bit): on a few rows a tenth of the time of
    torch's many small operations (2000 rows of a Q6_K table: 11 against 127 ms here)."""
    from gguf import GGMLQuantizationType, quants
    flat = ids.reshape(-1).numpy()
    rows = quants.dequantize(t.blocks()[flat].reshape(-1), GGMLQuantizationType(t.kind))
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(*ids.shape, -1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes of fifth bits a block -> (rows, blocks, 32) 0/1 in weight order (bit i: weight i)."""
    word = qh.contiguous().view(torch.int32)  # little-endian, as the file stores it
    return (word >> torch.arange(32, dtype=torch.int32)) & 1


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes a super-block -> its 8 sub-blocks' 6-bit scales and mins (..., 8), as gguf-py unpacks them."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


SIGNED = tuple(k for k, t in TYPES.items() if t.signed)  # w = s * q with signed q: see ``signed``
STORED = tuple(k for k, t in TYPES.items() if t.stored)  # to the block products from their bytes: ``regroup``


def raw_blocks(t: Tensor) -> torch.Tensor:
    """The tensor's blocks as stored, (rows, blocks per row, bytes per block) uint8 (a copy)."""
    return _blocks(t)


def mapped_blocks(t: Tensor) -> torch.Tensor:
    """``raw_blocks`` without the copy: a view of the file's read-only map, for a reader that only reads it
    and keeps nothing of it (the C++ repack; writing to it would fault). Not kept: a view holds the map."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read
        return torch.from_numpy(t.blocks())


def _fifth_tables() -> list[torch.Tensor]:
    """For byte m of a block's fifth bits (its weights 8 m .. 8 m + 7: half m // 2, chunks 2 (m % 2) + c', weight k
    of the chunk at bit 4 c' + k), each value's bits in the block products' 4 bytes (byte k, bit 2 c + half), as an
    int32 (little-endian: byte k at bits 8 k)."""
    v = torch.arange(256, dtype=torch.int32)
    tables = []
    for m in range(4):
        t = torch.zeros(256, dtype=torch.int32)
        for k in range(4):
            for c2 in range(2):
                c = 2 * (m % 2) + c2
                t |= ((v >> (4 * c2 + k)) & 1) << (8 * k + 2 * c + m // 2)
        tables.append(t)
    return tables


_FIFTH_TABLES = _fifth_tables()


def regroup(kind: int, raw: torch.Tensor, rows: int = 8) -> tuple:
    """Blocks of a type in ``STORED`` (``raw_blocks``, stacked along the rows) in the block products' layout
    (``quant.Blocks``), moved as stored, not decoded: (qs (groups, blocks, 128 or 256), qh (groups, blocks,
    32) or empty, scales (groups, blocks, rows) f16, mins likewise or empty, centre). The 16 bytes of 4-bit
    q hold weights 4c..4c+3 (low nibbles) and 16+4c.. (high) at bytes 4c..4c+3: chunk c as stored."""
    n, nb, _ = raw.shape
    groups = -(-n // rows)
    raw = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, groups * rows - n)).reshape(groups, rows, nb, -1)

    def halves(at: int) -> torch.Tensor:  # (groups, blocks, rows) f16
        return raw[..., at:at + 2].contiguous().view(torch.float16)[..., 0].transpose(1, 2).contiguous()

    def chunks(t: torch.Tensor, count: int) -> torch.Tensor:  # (groups, rows, blocks, count * 4) -> by chunk
        return t.reshape(groups, rows, nb, count, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1).contiguous()
    empty = torch.empty(0, dtype=torch.uint8)
    if kind == Q8_0:
        return chunks(raw[..., 2:], 8), empty, halves(0), torch.empty(0, dtype=torch.float16), 0.0
    qs = chunks(raw[..., -16:], 4)
    mins = halves(2) if kind in (Q4_1, Q5_1) else torch.empty(0, dtype=torch.float16)
    centre = 0.0 if kind in (Q4_1, Q5_1) else float(1 << (BITS[kind] - 1))
    if kind in (Q4_0, Q4_1):
        return qs, empty, halves(0), mins, centre
    at = 2 if kind == Q5_0 else 4
    # weight i = 16 half + 4 c + k of row j (bit i of the block's 4 bytes) -> bit 2 c + half of byte 4 j + k: each
    # of the 4 bytes gives its bits to the row's 4 bytes at once, by a table of their 4 bytes as an int32
    word = torch.zeros((groups, rows, nb), dtype=torch.int32)
    for m in range(4):
        word |= _FIFTH_TABLES[m][raw[..., at + m].long()]
    qh = word[..., None].view(torch.uint8).reshape(groups, rows, nb, 4).transpose(1, 2).reshape(groups, nb, rows * 4)
    return qs, qh.contiguous(), halves(0), mins, centre


K_QUANTS = (Q4_K, Q5_K, Q6_K)  # scales of 6 or 8 bits a sub-block times an f16 a super-block: ``k_parts``


def k_parts(t: Tensor) -> tuple:
    """A K-quant tensor (``K_QUANTS``) as its numbers unmultiplied: (q (rows, cols) uint8 in 0 .. 2^bits - 1 for
    Q4_K and Q5_K, int8 in -32 .. 31 for Q6_K; sc (rows, sub-blocks) its sub-blocks' scales, uint8 (int8 for
    Q6_K); mn (rows, sub-blocks) uint8 mins or None; d, dmin (rows, super-blocks) f16, dmin None for Q6_K), with
    w = d * sc * q - dmin * mn per sub-block of 32 weights (16 for Q6_K): what ``affine`` and ``signed`` multiply
    out, as gguf-py does (d * sc, then times q)."""
    blocks = _blocks(t)
    rows, n = blocks.shape[0], blocks.shape[1]
    halves = blocks[..., -2:] if t.kind == Q6_K else blocks[..., 0:4]
    f16 = halves.contiguous().view(torch.float16)  # (rows, n, 1 or 2)
    if t.kind == Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc = blocks[..., 192:208].contiguous().view(torch.int8)
        low = (ql.reshape(rows, n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0x0F
        high = (qh.reshape(rows, n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 0x03
        q = (low.reshape(rows, n, 256) | (high.reshape(rows, n, 256) << 4)).to(torch.int8) - 32
        return q.reshape(rows, -1), sc.reshape(rows, -1), None, f16[..., 0], None
    sc, mn = _k_scales(blocks[:, :, 4:16])
    qs = blocks[:, :, -128:].reshape(rows, -1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]
    q = (qs & 0x0F).reshape(rows, -1, 8, 32)
    if t.kind == Q5_K:
        qh = blocks[:, :, 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
        q = q | ((qh & 1) << 4)
    return q.reshape(rows, -1), sc.reshape(rows, -1), mn.reshape(rows, -1), f16[..., 0], f16[..., 1]


def signed(t: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 or Q6_K tensor as (q (rows, cols) int8, s (rows, cols / 32 for Q8_0, cols / 16 for Q6_K)
    float32) with w = s * q: each weight exactly as gguf-py dequantizes it (same float32 operations)."""
    if t.kind == Q8_0:
        return int8_parts(t)
    if t.kind != Q6_K:
        raise ValueError(f"{t.name}: {type_name(t.kind)} is not Q8_0 or Q6_K")
    q, sc, _, d, _ = k_parts(t)
    rows = q.shape[0]
    return q, (d.float()[..., None] * sc.reshape(rows, d.shape[1], -1).float()).reshape(rows, -1)


def affine(t: Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor of a type in ``AFFINE`` as (q (rows, cols) uint8 in 0 .. 2^bits - 1, s, z (rows, cols / 32)
    float32) with w = s * q + z: each weight exactly as gguf-py dequantizes it (same float32 operations)."""
    if t.kind in (Q4_K, Q5_K):
        q, sc, mn, d, dmin = k_parts(t)
        per = (q.shape[0], d.shape[1], 8)
        s = d.float()[..., None] * sc.reshape(per).float()  # (rows, super-blocks, 8), as gguf-py
        z = dmin.float()[..., None] * mn.reshape(per).float()
        return q, s.reshape(q.shape[0], -1), -z.reshape(q.shape[0], -1)
    blocks = _blocks(t)
    rows = blocks.shape[0]
    if t.kind in (Q4_0, Q4_1, Q5_0, Q5_1):
        d = _halves(blocks, 0)
        offset = 2 if t.kind in (Q4_0, Q5_0) else 4
        if t.kind in (Q4_0, Q4_1):
            q = _nibbles(blocks[:, :, offset:])
        else:
            low = _nibbles(blocks[:, :, offset + 4:]).reshape(rows, -1, BLOCK)
            q = (low | (_fifth_bits(blocks[:, :, offset:offset + 4]).to(torch.uint8) << 4)).reshape(rows, -1)
        if t.kind in (Q4_0, Q5_0):  # d * (q - 8 or 16), exactly: d has 11 bits, q - 16 at most 5
            return q, d, -float(1 << (BITS[t.kind] - 1)) * d
        return q, d, _halves(blocks, 2)
    if t.kind == Q8_0:
        q, d = int8_parts(t)
        return (q.to(torch.int16) + 128).to(torch.uint8), d, -128 * d
    raise ValueError(f"{t.name}: {type_name(t.kind)} is not of the form s * q + z per 32 weights")
