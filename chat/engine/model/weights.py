"""Building the engine's own decoder (``decoder.py``): from a GGUF file's blocks, or from a
transformers model of the same shape.

From a GGUF, nothing is converted to files. Once the C++ library is loaded (``native``), every block
type of the form w = s * q + z per 32 weights (``gguf.AFFINE``) or w = s * q per 32 or 16 (``gguf.SIGNED``:
Q8_0, Q6_K) goes to its block products (``quant.Blocks``): Q4_0..Q8_0 moved as stored (``gguf.regroup``),
K-quants from their decoded parts, exactly. Before that (a first start, no compiler), the ``AFFINE`` types
go to torch's int4 kernel exactly but for s and z in bf16 (Q4_0, Q4_1, Q4_K as one int4 product; Q5_0,
Q5_1, Q5_K, Q8_0 as two, ``quant.Sum``), and ``to_blocks`` moves them once the library is built. Other
types (Q2_K, Q3_K, F16, BF16, F32; Q6_K on the int4 path) are dequantized to dense weights, as parts of a
fused product where its other parts are quantized (``quant.Concat``). The token table serves lookups from
its q, s and z rows, or, tied and Q8_0 on the blocks, from the output layer's blocks. ``quant`` picks what
is kept:

- ``auto``: the quantized weights where the file has them, plus, on the int4 kernel on CPUs whose
  dense bf16 products are fast (native bf16, ``quant.POLICY``), the layers' dense copies for products
  of many rows (prefill), each product picking by its crossover, measured after start-up;
- ``int4``: the quantized weights only (least memory; on the int4 kernel long prompts prefill slower
  on native-bf16 CPUs);
- ``off``: dense only, every weight dequantized as gguf-py does.
"""
from __future__ import annotations

import logging

import torch

from ..kernels import gguf, quant
from ..kernels.blocktypes import TYPES
from ..kernels.quant import Linear
from .architecture import Architecture, for_gguf, for_hf, llama3_factors
from .decoder import Decoder, Embedding, Layer, Shape

log = logging.getLogger(__name__)



VERIFY_ROWS = 4096  # the output layer's rows ``verify`` checks (its first and last halves of these)


class Unsupported(Exception):
    """The model is not one the own decoder runs; the engine uses transformers' forward."""


# ---- from a GGUF file


def gguf_architecture(f: gguf.GGUFFile) -> Architecture:
    arch = for_gguf(f.architecture)
    if arch is None:
        raise Unsupported(f"architecture {f.architecture!r}")
    return arch


def gguf_shape(f: gguf.GGUFFile, context: int = 0) -> Shape:
    """The decoder's shape from a GGUF's metadata; ``context``: the positions it will serve (LongRoPE's choice)."""
    arch = gguf_architecture(f)
    heads = f.meta("attention.head_count")
    hidden = f.meta("embedding_length")
    head_dim = f.meta("attention.key_length") or hidden // heads
    problem = arch.gguf_problem(f.meta, f.tensors, head_dim)
    if problem:
        raise Unsupported(problem)
    rotary = f.meta("rope.dimension_count", head_dim)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise Unsupported(f"rotary positions over {rotary} of a head's {head_dim}")
    # Llama 3's scaling (rope_freqs), or LongRoPE's factors (Phi-3): a divisor per frequency. LongRoPE's long ones
    # serve a context past the original one and the short ones one within it, chosen for the whole context as
    # llama.cpp chooses them (transformers switches a sequence to the long ones once it passes the original length)
    freqs = f.tensors.get("rope_freqs.weight", f.tensors.get(f"rope_factors_{longrope(f, context)}.weight"))
    factors = tuple(gguf.dequantize(freqs).reshape(-1).tolist()) if freqs is not None else None
    if freqs is not None and factors is not None and len(factors) != rotary // 2:
        raise Unsupported(f"{freqs.name} of {len(factors)} values for rotary positions over {rotary}")
    layers = f.meta("block_count")
    return Shape(layers=layers, hidden=hidden, heads=heads,
                 kv_heads=f.meta("attention.head_count_kv") or heads, head_dim=head_dim,
                 eps=f.meta("attention.layer_norm_rms_epsilon"), rope_theta=f.meta("rope.freq_base", 10000.0),
                 rope_factors=factors, window=f.meta("attention.sliding_window", 0) if arch.sliding(0) else 0,
                 vocab=f.tensors["token_embd.weight"].shape[0], rotary_dim=rotary if rotary != head_dim else 0,
                 no_rope=tuple(i for i in range(layers) if not arch.rotary(i)),
                 rope_attention=f.meta("rope.scaling.attn_factor", 1.0) if "rope_factors_short.weight" in f.tensors
                 else 1.0)


def _llama_rows(heads: int, head_dim: int) -> torch.Tensor:
    """GGUF's llama q/k rows in transformers' order: llama.cpp's converter interleaved each head's
    two rotary halves (row 2i + j of a head holds transformers' row j * head_dim / 2 + i)."""
    half = head_dim // 2
    within = (torch.arange(half)[None, :] * 2 + torch.arange(2)[:, None]).reshape(-1)  # row j * half + i
    return (torch.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)


class _Reader:
    """The tensors of one GGUF file as the builder wants them (rows permuted where needed)."""

    def __init__(self, f: gguf.GGUFFile, shape: Shape, dtype: torch.dtype) -> None:
        self.f, self.dtype = f, dtype
        self.rows = {}
        if gguf_architecture(f).interleaved_qk:
            self.rows = {"attn_q": _llama_rows(shape.heads, shape.head_dim),
                         "attn_k": _llama_rows(shape.kv_heads, shape.head_dim)}

    def tensor(self, name: str) -> gguf.Tensor:
        return self.f.tensors[name]

    def _order(self, name: str, a: torch.Tensor) -> torch.Tensor:
        rows = self.rows.get(name.split(".")[-2])
        return a if rows is None else a[rows]

    def form(self, name: str, blocks: bool = False) -> int | None:
        """How the int4 kernel takes this tensor: 4 (one product), 8 (two: 5 to 8 bits), None (dense). With
        ``blocks`` (the C++ library's block products): the GGUF type itself, None for a dense one."""
        kind = self.tensor(name).kind
        if blocks:
            return kind if TYPES[kind].product else None
        bits = TYPES[kind].bits
        return None if bits is None else 4 if bits == 4 else 8

    def blocks(self, names: list[str]) -> quant.Blocks:
        """Tensors of one type stacked along the outputs, as a block product."""
        kind = self.tensor(names[0]).kind
        if kind in gguf.STORED:  # moved as stored; K-quants by the C++ repack straight from the file's map
            read = gguf.mapped_blocks if kind in gguf.K_QUANTS else gguf.raw_blocks
            raw = [self._order(n, read(self.tensor(n))) for n in names]
            return _stored(kind, raw[0] if len(raw) == 1 else torch.cat(raw))
        parts = [tuple(None if a is None else self._order(n, a) for a in _block_parts(self.tensor(n))) for n in names]
        return _block_product(kind, [None if p[0] is None else torch.cat(p) for p in zip(*parts)])

    def vector(self, name: str) -> torch.Tensor | None:
        if name not in self.f.tensors:
            return None
        return self.dense(name).reshape(-1)

    def affine(self, name: str) -> tuple:
        return tuple(self._order(name, a) for a in gguf.affine(self.tensor(name)))

    def dense(self, name: str) -> torch.Tensor:
        return self._order(name, gguf.dequantize(self.tensor(name))).to(self.dtype)

    def dense_rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows [begin, end) of a tensor stored in row order (not one whose rows ``_order`` permutes)."""
        assert name.split(".")[-2] not in self.rows
        return gguf.dequantize(gguf.rows(self.tensor(name), begin, end)).to(self.dtype)


def _block_parts(t: gguf.Tensor) -> tuple:
    if t.kind in gguf.K_QUANTS:
        return gguf.k_parts(t)
    return gguf.signed(t) if t.kind in gguf.SIGNED else gguf.affine(t)


def _block_product(kind: int, parts: list) -> quant.Blocks:
    if kind in gguf.K_QUANTS:  # their byte scales and f16 super-block scales as the file has them
        q, sc, mn, d, dmin = parts
        return quant.Blocks.from_k(q, sc, mn, d, dmin, gguf.BITS.get(kind, 6))  # Q6_K: 6
    if kind in gguf.SIGNED:
        return quant.Blocks.from_parts(parts[0], parts[1], None, 8)
    q, s, z = parts
    return quant.Blocks.from_parts(q, s, z, gguf.BITS[kind])


def _stored(kind: int, raw: torch.Tensor) -> quant.Blocks:
    if kind in gguf.K_QUANTS:
        return quant.Blocks.from_k_bytes(raw.shape[0], *torch.ops.chat_native.blocks_repack_k(kind, raw))
    qs, qh, scales, mins, centre = gguf.regroup(kind, raw, quant.Blocks.ROWS)
    product = TYPES[kind].product
    assert product is not None, gguf.type_name(kind)
    form = quant.Blocks.FORMS[product]
    if form == quant.Blocks.S8 and quant.unsigned_bytes():
        form, qs, centre = quant.Blocks.U8, qs ^ 0x80, 128.0  # q + 128: VNNI's dot product takes it at full range
    return quant.Blocks(form, raw.shape[0], qs, qh, scales, mins, centre)


def blocks(t: gguf.Tensor, stored: bool = True) -> quant.Blocks:
    """One tensor of a type in ``gguf.AFFINE`` or ``gguf.SIGNED`` as a block product (the library loaded):
    types in ``gguf.STORED`` moved as stored unless not ``stored`` (then from their decoded parts)."""
    if stored and t.kind in gguf.STORED:
        return _stored(t.kind, gguf.raw_blocks(t))
    return _block_product(t.kind, list(_block_parts(t)))


def _quantized(r: _Reader, names: list[str], blocks: bool = False):
    """The int4 kernel's form of a (fused) product (with ``blocks``: the C++ library's block products):
    runs of tensors of one form stacked along the outputs, a type the kernel cannot take as a dense part;
    None when every part is dense."""
    runs: list[tuple[int | None, list[str]]] = []
    for name in names:
        form = r.form(name, blocks)
        if runs and runs[-1][0] == form:
            runs[-1][1].append(name)
        else:
            runs.append((form, [name]))
    if all(form is None for form, _ in runs):
        return None
    built: list = []
    for form, group in runs:
        if form is None:
            built.append(quant.Dense(_dense(r, group)))
        elif blocks:
            built.append(r.blocks(group))
        else:
            q, s, z = (torch.cat(part) for part in zip(*(r.affine(n) for n in group)))
            built.append(quant.from_affine(q, s, z, form))
    return built[0] if len(built) == 1 else quant.Concat(built)


def _linear(r: _Reader, names: list[str], mode: str, dense_copies: bool, biases: list | None = None,
            blocks: bool = False) -> Linear:
    packed = _quantized(r, names, blocks) if mode != "off" else None
    dense = _dense(r, names) if packed is None or (mode == "auto" and dense_copies) else None
    bias = torch.cat(biases) if biases and all(b is not None for b in biases) else None
    return Linear(dense, packed, bias)


def longrope(f: gguf.GGUFFile, context: int) -> str:
    """Which of LongRoPE's factors a context of ``context`` positions takes: ``long`` past the original context."""
    original = f.meta("rope.scaling.original_context_length", 0)
    return "long" if original and context > original and "rope_factors_long.weight" in f.tensors else "short"


def from_gguf(f: gguf.GGUFFile, mode: str, dtype: torch.dtype = torch.bfloat16, dense_copies: bool = True,
              blocks: bool = False, context: int = 0) -> Decoder:
    """The decoder of a GGUF file's weights (see the module's docstring for ``mode``). ``dense_copies``:
    whether ``auto`` keeps dense copies of the int4 products for long prefills (``quant.POLICY``);
    ``blocks``: the file's blocks on the C++ library's products (loaded: ``build.load``) instead of the
    int4 kernel. ``context``: the positions it serves (Phi-3's LongRoPE factors: ``longrope``)."""
    shape, arch = gguf_shape(f, context), gguf_architecture(f)
    if dtype != torch.bfloat16:
        mode = "off"  # the int4 kernel takes bf16 activations only
    r = _Reader(f, shape, dtype)
    layers = []
    for i in range(shape.layers):
        qkv, o, gate_up, down = (_linear(r, names, mode, dense_copies, [r.vector(b) for b in biases], blocks)
                                 for names, biases in zip(arch.products(i), arch.biases(i)))
        attn_norm, mlp_norm = (r.vector(n) for n in arch.norms(i))
        heads = arch.head_norms(i)
        if heads and any(name not in f.tensors for name in heads):
            raise Unsupported(f"{arch.name} without {' and '.join(n for n in heads if n not in f.tensors)}")
        q_norm, k_norm = (r.vector(heads[0]), r.vector(heads[1])) if heads else (None, None)
        post = arch.post_norms(i)
        if post and any(name not in f.tensors for name in post):
            raise Unsupported(f"{arch.name} without {' and '.join(n for n in post if n not in f.tensors)}")
        post_attn, post_mlp = (r.vector(post[0]), r.vector(post[1])) if post else (None, None)
        layers.append(Layer(attn_norm=attn_norm, qkv=qkv, o=o, mlp_norm=mlp_norm, gate_up=gate_up, down=down,
                            q_norm=q_norm, k_norm=k_norm, post_attn_norm=post_attn, post_mlp_norm=post_mlp))
    table = "token_embd.weight"
    head_name = "output.weight" if "output.weight" in f.tensors else table
    head_quant = _quantized(r, [head_name], blocks) if mode != "off" else None
    if isinstance(head_quant, quant.Blocks) and head_name == table and head_quant.looked_up:
        # a tied Q8_0 or Q6_K table: lookups read the head's blocks (not a dense bf16 copy: 500 MB for Llama 3.2's)
        embed = Embedding(blocks=head_quant, dtype=dtype)
    elif mode != "off" and r.tensor(table).kind not in (gguf.F32, gguf.F16, gguf.BF16):
        # the file's blocks (copied: not the whole file kept mapped), rows de-quantized as looked up
        embed = Embedding(table=gguf.copied(r.tensor(table)), dtype=dtype)
    else:
        embed = Embedding(dense=r.dense(table), dtype=dtype)
    if head_quant is not None:
        head = Linear(quant=head_quant)
    elif head_name == table and embed.dense is not None:
        head = Linear(embed.dense)
    else:
        head = Linear(r.dense(head_name))
    quantized = mode != "off" and any(lin.quant is not None for lin in (layers[0].qkv, layers[0].gate_up))
    weights = ("blocks" if blocks else "int4") if quantized else str(dtype).removeprefix("torch.")
    return Decoder(shape, embed, layers, r.vector("output_norm.weight"), head, weights, dtype, arch)


def to_blocks(f: gguf.GGUFFile, decoder: Decoder, dense_copies: bool) -> bool:
    """Move a decoder read from ``f`` onto the C++ library's block products (once it is loaded), checked
    first (``verify``); the dense copies stay where ``dense_copies``. False (and nothing changed) when the
    check fails."""
    fresh = from_gguf(f, "int4", decoder.dtype, dense_copies=False, blocks=True)
    if fresh.weights != "blocks" or not verify(f, fresh):
        log.warning("the block products disagree with the dense weights on this machine: staying on the int4 kernel")
        return False
    for linear, new in zip([*decoder.linears(), decoder.head], [*fresh.linears(), fresh.head]):
        if new.quant is None:
            continue
        if not dense_copies or linear is decoder.head:
            linear.dense = None
        linear.quant, linear.crossover = new.quant, Linear.ALWAYS
    decoder.embed, decoder.weights = fresh.embed, "blocks"
    log.info("weights on the block products: %s", ", ".join(f"{k} {v}" for k, v in decoder.formats().items()))
    return True


def _dense(r: _Reader, names: list[str]) -> torch.Tensor:
    return torch.cat([r.dense(n) for n in names]) if len(names) > 1 else r.dense(names[0])


def verify(f: gguf.GGUFFile, decoder: Decoder, tolerance: float = 0.02) -> bool:
    """The int4 products of the first and last layers and of the output layer, on a fixed input,
    against the same product over the file's weights dequantized in float32: False when any
    differs by more than ``tolerance`` of the reference's size (a kernel or packing that computes
    something else; bf16 rounding alone stays near 0.005)."""
    shape = decoder.shape
    r = _Reader(f, shape, torch.float32)
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    checks = []
    for i in (0, shape.layers - 1):
        layer = decoder.layers[i]
        checks += list(zip((layer.qkv, layer.o, layer.gate_up, layer.down), gguf_architecture(f).products(i)))
    found = [(linear, lambda names=names: _dense(r, names), names[0], None) for linear, names in checks]
    # the output layer by its first and last rows (a 262,144-token table in float32 is a gigabyte and seconds)
    t = f.tensors[head]
    ends = min(t.rows // 2, VERIFY_ROWS // 2)
    rows = torch.cat([torch.arange(ends), torch.arange(t.rows - ends, t.rows)])
    return _agree([(decoder.head, lambda: torch.cat([r.dense_rows(head, 0, ends), r.dense_rows(head, t.rows - ends,
                                                                                               t.rows)]),
                    head, rows), *found], tolerance)


def _agree(checks: list, tolerance: float) -> bool:
    """Each (Linear, its float32 reference weights (a function), name[, the output rows the reference holds, or
    None: all]): the int4 product on a fixed input within ``tolerance`` of the reference's, relative to its
    size."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for linear, reference_of, name, *rows in checks:
            if linear.quant is None:
                continue
            reference = reference_of()
            x = torch.randn(4, reference.shape[1], generator=generator)
            want = x @ reference.T
            got = linear.quant(x.to(torch.bfloat16)).float()
            if rows and rows[0] is not None:
                got = got[:, rows[0]]
            error = float((got - want).norm() / want.norm())
            if not error <= tolerance:  # NaN fails too
                log.warning("int4 self-check: %s differs by %.3g of its size", name, error)
                return False
    return True


# ---- dense weights quantized on load (hub and folder models)


def q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of a dense (rows, cols) matrix, as ``gguf.affine`` gives a Q8_0 tensor: per 32 weights
    d = max |w| / 127 (kept in f16) and q = round(w / d), so w ~ d * (q + 128) - 128 d."""
    blocks = weight.float().reshape(weight.shape[0], -1, gguf.BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = blocks * inverse[..., None]
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int16) + 128  # half away from 0
    d = d.half().float()
    return q.to(torch.uint8).reshape(weight.shape), d, -128 * d


def quantize(decoder: Decoder, dense_copies: bool, tolerance: float = 0.02, blocks: bool = False) -> bool:
    """Put a dense decoder's layers and output layer on the int4 kernel as Q8_0 (two int4 products each:
    ``quant.Sum``), keeping the dense weights only where ``dense_copies`` (``quant.POLICY``). Checked on the
    first and last layers and the output layer before the dense weights go; False (and nothing changed)
    when the check fails. The token table stays dense (lookups)."""
    linears = [*decoder.linears(), decoder.head]
    made = quant.Blocks.from_parts if blocks else quant.from_affine  # the C++ library's block products, once loaded
    built = [made(*q8_0(linear.dense), 8) for linear in linears]
    last = len(decoder.layers) - 1
    sample = {0, 1, 2, 3, 4 * last, 4 * last + 1, 4 * last + 2, 4 * last + 3, len(linears) - 1}
    checks = [(Linear(quant=built[i]), lambda i=i: linears[i].dense.float(), f"product {i}") for i in sorted(sample)]
    if not _agree(checks, tolerance):
        return False
    for i, (linear, q) in enumerate(zip(linears, built)):
        keep = dense_copies and i < len(linears) - 1  # the output layer is a decode-step product only
        if linear is decoder.head:
            decoder.head = Linear(linear.dense if keep else None, q, linear.bias)
        else:
            linear.quant = q
            linear.dense = linear.dense if keep else None
            linear.crossover = Linear.ALWAYS
    decoder.weights = "blocks" if blocks else "int4"
    return True


# ---- from a transformers model


def from_hf(model: torch.nn.Module) -> Decoder:
    """The decoder of a transformers Llama/Qwen2/Mistral model's (dense) weights. The fused
    matrices take the model's place: its modules then hold views of them, so no weight is kept twice."""
    cfg = model.config.get_text_config(decoder=True)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    arch = for_hf(cfg.model_type)
    if arch is None:
        raise Unsupported(f"model type {cfg.model_type!r}")
    problem = arch.hf_problem(cfg)
    if problem:
        raise Unsupported(problem)
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    factors = None
    if rope.get("rope_type", rope.get("type")) == "llama3":
        factors = tuple(llama3_factors(theta, head_dim, rope["factor"], rope["low_freq_factor"],
                                       rope["high_freq_factor"], rope["original_max_position_embeddings"]))
    shape = Shape(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
                  kv_heads=cfg.num_key_value_heads or heads, head_dim=head_dim, eps=cfg.rms_norm_eps,
                  rope_theta=theta, vocab=cfg.vocab_size, rope_factors=factors,
                  # SmolLM3's no_rope_layers: 1 where a layer has rotary positions
                  no_rope=tuple(i for i, r in enumerate(getattr(cfg, "no_rope_layers", None) or []) if not r))
    inner = model.get_decoder()
    layers = []
    for block in inner.layers:
        a, m = block.self_attn, block.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # qk_norm (Qwen3)
        layers.append(Layer(attn_norm=block.input_layernorm.weight.data,
                            qkv=_fuse([a.q_proj, a.k_proj, a.v_proj]), o=_fuse([a.o_proj]),
                            mlp_norm=block.post_attention_layernorm.weight.data,
                            gate_up=_fuse([m.gate_proj, m.up_proj]), down=_fuse([m.down_proj]),
                            q_norm=q_norm.weight.data if q_norm is not None else None,
                            k_norm=k_norm.weight.data if k_norm is not None else None))
    dtype = inner.embed_tokens.weight.dtype
    head = model.get_output_embeddings().weight.data
    return Decoder(shape, Embedding(dense=inner.embed_tokens.weight.data, dtype=dtype), layers,
                   inner.norm.weight.data, Linear(head), str(dtype).removeprefix("torch."), dtype, arch)


def _fuse(modules: list) -> Linear:
    if len(modules) == 1:
        m = modules[0]
        return Linear(m.weight.data, bias=m.bias.data if m.bias is not None else None)
    biases = [m.bias.data if m.bias is not None else None for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise Unsupported("bias on some of the fused projections only")
    weight = torch.cat([m.weight.data for m in modules])
    bias = torch.cat(biases) if biases[0] is not None else None
    start = 0
    for m in modules:  # the modules keep working (transformers' forward, generate) on views
        n = m.weight.shape[0]
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return Linear(weight, bias=bias)
