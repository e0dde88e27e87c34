"""The engine's own forward pass for Llama-shaped decoders (Llama, SmolLM, Qwen2, Qwen3, Mistral without
a sliding window): RMSNorm, rotary positions, grouped-query attention, SwiGLU; q/k biases and per-head
q/k norms where the architecture has them.

A hundred lines of plain torch instead of transformers' modules: one fused
q/k/v and one fused gate/up product per layer, keys and values written straight
into the engine's ``KVBuffer``, attention by SDPA over each run of rows' own
columns in a decode step (``attention.plan``), logits only for each row's last
position, and each product on int4 or dense weights by its number of rows
(``quant.Linear``). Arithmetic follows transformers' (bf16 activations, norms
in float32), so the dense path's answers are transformers' answers.

Decode steps run in C++ instead (``native``) once that step is built and checked:
the same layers in one call.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..kernels import gguf, quant
from ..kernels.quant import Linear
from ..kv.buffer import KVBuffer, windows_kept
from .architecture import ARCHITECTURES, Architecture


@dataclass
class Shape:
    """What the forward needs to know of the model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    vocab: int
    rope_factors: tuple[float, ...] | None = None  # a divisor per rotary frequency (Llama 3's scaling), or None
    window: int = 0  # the sliding-window layers' span in positions (0: none)
    rotary_dim: int = 0  # the part of a head with rotary positions, from its start (0: all of it; Phi-4-mini: 3/4)
    no_rope: tuple[int, ...] = ()  # layers without rotary positions (SmolLM3's every fourth)
    rope_attention: float = 1.0  # cos and sin scaled by this (LongRoPE's attention factor)

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None  # an RMSNorm over each query head (head dim), before rotary positions
    k_norm: torch.Tensor | None = None  # the same over each key head
    post_attn_norm: torch.Tensor | None = None  # gemma_norms: after the attention, before the residual add
    post_mlp_norm: torch.Tensor | None = None  # gemma_norms: after the MLP, before the residual add


class Embedding:
    """Token ids -> activation rows: from a dense table, or from a quantized table kept as the file's
    blocks (``table``: only the rows looked up are de-quantized, each as ``gguf.dequantize`` gives it),
    then rounded to the activations' type."""

    def __init__(self, dense: torch.Tensor | None = None, table: gguf.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, blocks: quant.Blocks | None = None) -> None:
        self.dense, self.table, self.dtype, self.blocks = dense, table, dtype, blocks

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.embedding(ids, self.dense)
        if self.blocks is not None:  # a tied Q8_0 table: the output layer's blocks
            return self.blocks.lookup(ids).to(self.dtype)
        assert self.table is not None
        return gguf.lookup(self.table, ids).to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Its weights' bytes (a table: the file's, mapped; blocks: counted as the head's)."""
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        return int(self.table.raw.nbytes) if self.table is not None else 0


class Decoder:
    """A Llama-shaped decoder the engine calls as ``forward(ids, kv, positions, spans)``."""

    def __init__(self, shape: Shape, embed: Embedding, layers: list[Layer], norm: torch.Tensor, head: Linear,
                 weights: str, dtype: torch.dtype = torch.bfloat16, architecture: Architecture | None = None) -> None:
        self.shape, self.embed, self.layers, self.norm, self.head = shape, embed, layers, norm, head
        self.architecture = architecture or ARCHITECTURES["llama"]  # the description its weights were read by
        self.weights = weights  # what the decode path multiplies by: "int4", "bfloat16", ...
        self.native: Callable[..., torch.Tensor] | None = None  # the C++ step (native.Step), once built and checked
        self.dtype = dtype  # of activations and dense weights
        features = self.architecture.features
        self.embed_scale = "embed_scale" in features
        self.gemma_norms = "gemma_norms" in features
        self.gelu = "gelu" in features
        rot = shape.rotary
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        if shape.rope_factors is not None:  # Llama 3's scaling, as llama.cpp applies it: each frequency divided
            self.inv_freq = self.inv_freq / torch.tensor(shape.rope_factors, dtype=torch.float)
        # the windowed layers' own rotary base (sliding_window)
        self.local_inv_freq = 1.0 / (self.architecture.local_rope_theta ** (
            torch.arange(0, rot, 2, dtype=torch.float) / rot))
        self._angles: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # local or not -> (cos, sin) by position
        # the columns a row taken out of a KV buffer keeps per layer: a windowed layer's window and a few more
        self.keep = windows_kept([shape.window if self.architecture.sliding(i) else 0 for i in range(shape.layers)]) \
            if shape.window else ()

    def widened(self) -> Decoder:
        """This decoder on the same weights with its activations in float32 between the products (norms, rotary
        positions, attention, the MLP's gate and the residual sums unrounded; each product's input still rounded to
        bf16, as its kernels take it): a reference nearer exact arithmetic than either bf16 step, for checks."""
        wide = copy.copy(self)
        wide.dtype, wide._angles, wide.native = torch.float32, {}, None
        wide.layers = [replace(x, qkv=_Wide(x.qkv), o=_Wide(x.o), gate_up=_Wide(x.gate_up), down=_Wide(x.down))
                       for x in self.layers]
        wide.head = _Wide(self.head)
        return wide

    def cache(self, rows: int, capacity: int) -> KVBuffer:
        """An empty KV buffer of ``rows`` rows for this decoder (outside the engine: benchmarks, checks)."""
        s = self.shape
        return KVBuffer(s.layers, s.kv_heads, s.head_dim, self.dtype, torch.device("cpu"), rows=rows,
                        capacity=capacity, active=rows, keep=self.keep)

    def formats(self) -> dict[str, str]:
        """What each class of product multiplies by at decode: ``int4`` (4-bit weights), ``int4x2`` (5 to 8
        bits as two int4 products) or a dense type; several joined by ``+`` where layers or parts differ."""
        def forms(linears: list[Linear]) -> str:
            found: dict[str, None] = {}
            for linear in linears:
                for part in quant.parts(linear.quant) if linear.quant is not None else [linear]:
                    found[_form(part)] = None
            return "+".join(found)
        classes = {"qkv": [x.qkv for x in self.layers], "o": [x.o for x in self.layers],
                   "gate_up": [x.gate_up for x in self.layers], "down": [x.down for x in self.layers]}
        return {**{name: forms(linears) for name, linears in classes.items()}, "output": forms([self.head])}

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def nbytes(self) -> int:
        norms = sum(t.numel() * t.element_size() for layer in self.layers
                    for t in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.post_attn_norm,
                              layer.post_mlp_norm) if t is not None)
        shared = (self.head.quant is None and self.embed.dense is not None
                  and self.head.dense is not None and self.head.dense.data_ptr() == self.embed.dense.data_ptr())
        return (sum(lin.nbytes for lin in self.linears()) + norms + self.embed.nbytes
                + (0 if shared else self.head.nbytes))

    def _rope(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (rows, columns) -> (rows, columns, 1, head dim), as transformers
        computes them (float32, then the activations' type); ``local``: the windowed layers' base."""
        need = int(positions.max()) + 1
        held = self._angles.get(local)
        if held is not None and need <= held[0].shape[0]:
            cos, sin = held
        else:
            size = max(need, 2 * held[0].shape[0] if held is not None else 0, 256)
            freqs = torch.outer(torch.arange(size, dtype=torch.float), self.local_inv_freq if local else self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = self.shape.rope_attention  # LongRoPE's, applied in float32 as transformers does
            cos, sin = self._angles[local] = (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.gemma_norms:  # the weight applied in float32, then rounded (Gemma's)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.eps) * weight.float()).to(self.dtype)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.eps).to(self.dtype)

    def forward(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor, spans: list | None = None,
                native: Callable[..., torch.Tensor] | Literal[False] | None = None,
                every: bool = False) -> torch.Tensor:
        """Float logits of each row's last column after feeding ``input_ids`` (rows, columns). A decode
        step runs in C++ once ``native`` is set (``native=False``: on torch ops all the same).
        ``every``: every column's logits (rows, columns, vocab), for scoring a prompt."""
        s = self.shape
        rows, cols = input_ids.shape
        cos, sin = self._rope(position_ids)
        h = self._embed(input_ids.reshape(-1))
        decode = cols == 1
        step = self.native if native is None else native
        if decode and step:
            return self._logits(step(h, kv, cos, sin, self._rope(position_ids, local=True) if s.window else None))
        mask = _mask(kv, cols)
        windowed = mask
        if s.window and int(position_ids.max()) >= s.window:  # some key is out of the windowed layers' reach
            windowed = _window_mask(kv, cols, position_ids, s.window, decode)
        local = self._rope(position_ids, local=True) if s.window else (cos, sin)
        for i, layer in enumerate(self.layers):
            sliding = bool(s.window) and self.architecture.sliding(i)
            layer_mask = windowed if sliding else mask
            layer_cos, layer_sin = local if sliding else (cos, sin)
            qkv = layer.qkv(self._norm(h, layer.attn_norm), decode).view(rows, cols, -1, s.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:  # qk_norm: each head normed on its own
                qkv = torch.cat([self._norm(qkv[:, :, :s.heads], layer.q_norm),
                                 self._norm(qkv[:, :, s.heads:s.heads + s.kv_heads], layer.k_norm),
                                 qkv[:, :, s.heads + s.kv_heads:]], dim=2)
            qk = qkv[:, :, :s.heads + s.kv_heads]
            if i not in s.no_rope:
                qk = _rotate(qk, layer_cos, layer_sin)  # q and k at once
            qk = qk.transpose(1, 2)
            q, k = qk[:, :s.heads], qk[:, s.heads:]
            keys, values = kv.write(i, k, qkv[:, :, s.heads + s.kv_heads:].transpose(1, 2))
            layer_spans = spans
            if sliding and layer_mask is not None and windowed is not mask:
                # the columns before every new column's window left out: a windowed layer's attention costs its
                # window, not the whole context (a row's columns advance with its positions)
                lo = kv.length - s.window + 1 - kv.start
                if lo > 0:
                    keys, values, layer_mask = keys[:, :, lo:], values[:, :, lo:], layer_mask[..., lo:]
                    layer_spans = [(b, e, max(c - lo, 0)) for b, e, c in spans] if spans is not None else None
            a = _attend(q, keys, values, layer_mask, layer_spans)
            out = layer.o(a.transpose(1, 2).reshape(rows * cols, -1), decode)
            h = h + (self._norm(out, layer.post_attn_norm) if layer.post_attn_norm is not None else out)
            gate, up = layer.gate_up(self._norm(h, layer.mlp_norm), decode).chunk(2, dim=-1)
            out = layer.down((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up, decode)
            h = h + (self._norm(out, layer.post_mlp_norm) if layer.post_mlp_norm is not None else out)
        if every:
            return self._logits(h).view(rows, cols, -1)
        return self._logits(h.view(rows, cols, -1)[:, -1])

    def verify(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor) -> torch.Tensor:
        """Float logits of every column (rows x columns, vocab) after feeding ``input_ids`` (rows, columns)
        on the C++ step: each column's bit for bit what a decode step of that column alone gives, so a
        drafted token is checked as the answer would have made it (``drafts``). Needs ``native``, and
        products that take the same path for that many rows as for one (``same_path``)."""
        assert self.native, "the C++ step verifies drafts"
        cos, sin = self._rope(position_ids)
        local = self._rope(position_ids, local=True) if self.shape.window else None
        return self._logits(self.native(self._embed(input_ids.reshape(-1)), kv, cos, sin, local))

    def verify_rows(self, tokens: list[list[int]], kv: KVBuffer, positions: list[int]) -> torch.Tensor:
        """``verify`` for several rows, each its own number of columns (drafts beyond one row): row r's
        ``tokens[r]`` from ``positions[r]`` into columns ``kv.length`` on (opened here for the longest; a shorter row's
        other columns are left for ``KVBuffer.settle``) -> float logits (every row's columns together, row after row,
        vocab), each column's bit for bit a decode step of that row alone."""
        assert self.native, "the C++ step verifies drafts"
        kv.open(max(len(t) for t in tokens))
        flat = torch.tensor([[token for row in tokens for token in row]])
        places = torch.tensor([[p + j for row, p in zip(tokens, positions) for j in range(len(row))]])
        cos, sin = self._rope(places)
        local = self._rope(places, local=True) if self.shape.window else None
        return self._logits(self.native(self._embed(flat.reshape(-1)), kv, cos, sin, local,
                                        counts=[len(t) for t in tokens]))

    def same_path(self, rows: int) -> bool:
        """Whether every product, the output's too, multiplies ``rows`` rows on the kernel it takes for one
        (quantized weights, no dense copy taking over past a crossover; a dense product's kernel changes
        with the rows)."""
        return all(lin.quant is not None and (lin.dense is None or lin.crossover >= rows)
                   for lin in [*self.linears(), self.head])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.embed_scale:  # sqrt(hidden) in the activations' type, as Gemma scales them
            h = h * torch.tensor(self.shape.hidden ** 0.5, dtype=h.dtype)
        return h

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.head(self._norm(last, self.norm)).float()

    __call__ = forward


class _Wide(Linear):
    """A product's weights taking and giving float32 activations (``Decoder.widened``): the input rounded to the
    type its kernels take, the output widened."""

    def __init__(self, linear: Linear) -> None:
        super().__init__(linear.dense, linear.quant, linear.bias)
        self.crossover = linear.crossover

    def __call__(self, x: torch.Tensor, decode: bool = True) -> torch.Tensor:
        kind = self.dense.dtype if self.dense is not None else torch.bfloat16
        return super().__call__(x.to(kind), decode).float()


def _form(part: Any) -> str:
    if isinstance(part, quant.Blocks):
        return part.form
    if isinstance(part, quant.Int4):
        return "int4"
    if isinstance(part, quant.Sum):
        return "int4x2"
    weight = part.weight if isinstance(part, quant.Dense) else part.dense
    return str(weight.dtype).removeprefix("torch.")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: the rest of each head passes unchanged
        return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _mask(kv: KVBuffer, cols: int) -> torch.Tensor | None:
    """(rows, 1, cols, keys) bool: each new column sees the real keys up to itself (and a padding
    column itself, so no query attends to nothing); in a decode step the additive form (0 or -inf).
    None where plain causal attention is the same: a lone row's decode step, and a chunk that
    starts its rows' keys without padding (SDPA's causal path is twice as fast as a mask)."""
    if cols == 1:
        if kv.n == 1:
            return None  # a lone row's columns are all its own
        real = kv.attention_mask(1)[:, None, None, :]
        return torch.zeros(real.shape, dtype=kv.dtype).masked_fill_(real == 0, float("-inf"))
    if kv.length == kv.start and bool(kv.mask[:kv.n, kv.length:kv.length + cols].all()):
        return None
    real = kv.attention_mask(cols).bool()[:, None, None, :]
    keys = real.shape[-1]
    query = torch.arange(keys - cols, keys)[:, None]
    key = torch.arange(keys)[None, :]
    return (real & (key <= query)) | (key == query)


def _window_mask(kv: KVBuffer, cols: int, positions: torch.Tensor, window: int, decode: bool) -> torch.Tensor:
    """``_mask`` for a windowed layer: each new column sees the real keys up to itself whose positions are within
    ``window`` of its own (a key's position: the real columns of its row before it). Bool (rows, 1, cols, keys);
    in a decode step the additive form."""
    real = kv.attention_mask(cols).bool()
    keys = real.shape[-1]
    near = (real.long().cumsum(-1) - 1)[:, None, :] > positions[:, :, None] - window  # (rows, cols, keys)
    query = torch.arange(keys - cols, keys)[:, None]
    key = torch.arange(keys)[None, :]
    allowed = ((real[:, None, :] & near & (key <= query)) | (key == query))[:, None]
    if decode:
        return torch.zeros(allowed.shape, dtype=kv.dtype).masked_fill_(~allowed, float("-inf"))
    return allowed


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            spans: list | None) -> torch.Tensor:
    """Attention with grouped-query heads: SDPA for a prefill chunk; for a decode step plain
    products (torch's CPU flash kernel costs ~0.2 ms a call for one query, more than the
    arithmetic), one call per run of rows in ``spans`` over the columns that run uses."""
    if q.shape[2] != 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True)
    if spans is None:
        return _decode_attention(q, keys, values, mask)
    assert mask is not None  # a decode step of several rows has one
    return torch.cat([_decode_attention(q[b:e], keys[b:e, :, c:], values[b:e, :, c:], mask[b:e, ..., c:])
                      for b, e, c in spans])


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """One query per row: the query heads that share a key/value head attend together, in float32.

    The scores are computed as keys x queries (not queries x keys): then a row's scores, like its
    weighted sum of values, come out bit for bit the same whatever padding or other rows share the
    call, so a seeded answer does not depend on the batch (the other order's kernel varies its
    summation with the number of keys)."""
    rows, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(keys.float().contiguous(), grouped.transpose(-1, -2)).transpose(-1, -2).mul_(dim ** -0.5)
    if mask is not None:
        scores += mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, values.float()).to(q.dtype).view(rows, heads, 1, dim)
