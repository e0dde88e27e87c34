"""One description per model architecture the engine's own decoder runs, read by the weight loader
(``weights.py``: names, row order, shape), the torch decoder and the C++ step (``native.COVERS``: the
block features it computes, checked once before it is used).

Every architecture here is Llama-shaped: RMSNorm, rotary positions, grouped-query attention, a gated MLP.
What differs is named, not branched on: GGUF's tensor names, whether llama.cpp's
converter interleaved the q/k rows, which transformers ``model_type`` values map here, and ``features``
beyond that core. Adding an architecture is one more ``Architecture`` in ``ARCHITECTURES`` plus tests
(docs/development.md); one whose block computes something else runs on transformers' forward.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

# Block features beyond the Llama core, and what each means for the weights (read where the file has them).
FEATURES = {
    "qkv_bias": "the q, k and v products may have biases (attn_q/attn_k/attn_v.bias: Qwen2's have)",
    "o_bias": "the attention output product may have a bias (attn_output.bias)",
    "qk_norm": "an RMSNorm over each query and key head before rotary positions (attn_q_norm/attn_k_norm.weight: "
               "Qwen3's, Gemma 3's)",
    "embed_scale": "the embeddings multiplied by sqrt(hidden) (Gemma's)",
    "gemma_norms": "each norm's weight applied in float32 before rounding, and a norm after the attention and after "
                   "the MLP too (post_attention_norm, post_ffw_norm: Gemma 2 and 3's)",
    "gelu": "a GELU (tanh) gated MLP instead of SwiGLU (Gemma's)",
    "sliding_window": "attention over a window of the latest positions on all but every n-th layer, those layers' "
                      "rotary positions of their own base (Gemma 3's)",
    "no_rope": "every n-th layer without rotary positions (SmolLM3's: every fourth, as llama.cpp fixes it)",
    "fused": "one q/k/v matrix (attn_qkv) and one gate/up matrix (ffn_up, gate rows first) per layer (Phi-3's)",
}


@dataclass(frozen=True)
class Limits:
    """What the own decoder and the C++ step compute of a block's shape; a file or a config outside these runs
    on transformers' forward (``Architecture.gguf_problem``/``hf_problem`` name what is outside)."""

    # rotary scaling kinds computed ("none": the base theta alone; "llama3": Llama 3's frequency-dependent
    # factors, which llama.cpp's converter writes as rope_freqs.weight)
    rope_scaling: tuple[str, ...] = ("none",)  # "longrope": Phi-3's factors files (rope_factors_long/short)
    partial_rotary: bool = False  # rotary positions over part of a head
    activations: tuple[str, ...] = ("silu",)  # the gated MLP's activation (transformers' hidden_act)
    sliding_window: bool = False  # attention over a window of the latest positions
    mlp_bias: bool = False


@dataclass(frozen=True)
class Architecture:
    name: str  # GGUF's general.architecture
    hf_types: tuple[str, ...]  # transformers' config.model_type values read with this description
    features: frozenset[str] = frozenset()
    interleaved_qk: bool = False  # llama.cpp's converter interleaved each q/k head's rotary halves
    limits: Limits = Limits()
    global_every: int = 0  # sliding_window: every n-th layer attends over everything (Gemma 3: 6)
    local_rope_theta: float = 10000.0  # sliding_window: the windowed layers' rotary base
    no_rope_every: int = 0  # no_rope: every n-th layer has no rotary positions (SmolLM3: 4)

    def gguf_problem(self, meta: Callable[[str, Any], Any], tensors: Container[str], head_dim: int) -> str | None:
        """What of a GGUF file's block (``meta(key, default)``: its ``<arch>.`` metadata) is outside ``limits``,
        or None. Linear rope scaling by 1.0 is none."""
        kind = meta("rope.scaling.type", "none")
        if kind == "linear" and meta("rope.scaling.factor", 1.0) == 1.0:
            kind = "none"
        if kind == "none" and "rope_freqs.weight" in tensors:
            kind = "llama3"  # per-frequency factors in the file (llama.cpp's form of Llama 3's scaling)
        if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            kind = "longrope"  # Phi-3's LongRoPE: short factors within the original context, long beyond
        if kind not in self.limits.rope_scaling or (kind == "none" and meta("rope.scaling.factor", 1.0) != 1.0):
            return "rope scaling"
        if not self.limits.partial_rotary and meta("rope.dimension_count", head_dim) != head_dim:
            return "partial rotary"
        return None

    def hf_problem(self, cfg: Any) -> str | None:
        """What of a transformers text config is outside ``limits``, or None."""
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window",
                                                                    cfg.model_type == "mistral")
        if (kind if kind != "default" else "none") not in self.limits.rope_scaling \
                or getattr(cfg, "hidden_act", "silu") not in self.limits.activations \
                or getattr(cfg, "mlp_bias", False) and not self.limits.mlp_bias \
                or windowed and not self.limits.sliding_window:
            return "rope scaling, activation, MLP bias or sliding window"
        return None

    def products(self, layer: int) -> list[list[str]]:
        """The GGUF names behind each of a layer's four products: q/k/v, output, gate/up, down."""
        p = f"blk.{layer}."
        if "fused" in self.features:
            return [[p + "attn_qkv.weight"], [p + "attn_output.weight"], [p + "ffn_up.weight"],
                    [p + "ffn_down.weight"]]
        return [[p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], [p + "attn_output.weight"],
                [p + "ffn_gate.weight", p + "ffn_up.weight"], [p + "ffn_down.weight"]]

    def biases(self, layer: int) -> list[list[str]]:
        """Each product's bias names (a product without any: an empty list), as its features say."""
        p = f"blk.{layer}."
        qkv = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if "qkv_bias" in self.features else []
        o = [p + "attn_output.bias"] if "o_bias" in self.features else []
        return [qkv, o, [], []]

    @staticmethod
    def norms(layer: int) -> tuple[str, str]:
        return f"blk.{layer}.attn_norm.weight", f"blk.{layer}.ffn_norm.weight"

    def post_norms(self, layer: int) -> tuple[str, str] | None:
        """The norms after the attention and after the MLP, where the architecture has them (``gemma_norms``)."""
        if "gemma_norms" not in self.features:
            return None
        return f"blk.{layer}.post_attention_norm.weight", f"blk.{layer}.post_ffw_norm.weight"

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a window (``sliding_window``) rather than everything."""
        return "sliding_window" in self.features and (layer + 1) % self.global_every != 0

    def rotary(self, layer: int) -> bool:
        """Whether ``layer`` has rotary positions (``no_rope``: every n-th has none)."""
        return "no_rope" not in self.features or (layer + 1) % self.no_rope_every != 0

    def head_norms(self, layer: int) -> tuple[str, str] | None:
        """The per-head query and key norms' names, where the architecture has them (``qk_norm``)."""
        if "qk_norm" not in self.features:
            return None
        return f"blk.{layer}.attn_q_norm.weight", f"blk.{layer}.attn_k_norm.weight"


ARCHITECTURES = {
    a.name: a for a in (
        Architecture("llama", ("llama", "mistral"), frozenset({"qkv_bias", "o_bias"}), interleaved_qk=True,
                     limits=Limits(rope_scaling=("none", "llama3"))),
        Architecture("qwen2", ("qwen2",), frozenset({"qkv_bias", "o_bias"})),
        Architecture("qwen3", ("qwen3",), frozenset({"qk_norm"})),
        # llama.cpp's converter writes SmolLM3 as Llama (q/k interleaved) and fixes a layer in four without rotary
        # positions (transformers' default no_rope_layer_interval); the GGUF carries no list of them
        Architecture("smollm3", ("smollm3",), frozenset({"no_rope"}), interleaved_qk=True, no_rope_every=4),
        # fused q/k/v and gate/up, rotary positions over part of a head where the file says (Phi-4-mini: 3/4), and
        # LongRoPE's factors where the file has them; its sliding_window metadata is not used (nor by llama.cpp)
        Architecture("phi3", (), frozenset({"fused"}),
                     limits=Limits(rope_scaling=("none", "longrope"), partial_rotary=True)),
        # GGUF only (llama.cpp's converter stores its norms as 1 + w); attention scaled by 1/sqrt(head size), as
        # llama.cpp does for the sizes up to 12B (query_pre_attn_scalar is the head size there)
        Architecture("gemma3", (), frozenset({"qk_norm", "embed_scale", "gemma_norms", "gelu", "sliding_window"}),
                     limits=Limits(activations=("gelu_pytorch_tanh",), sliding_window=True), global_every=6),
    )
}


def for_gguf(name: str) -> Architecture | None:
    return ARCHITECTURES.get(name)


def for_hf(model_type: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if model_type in a.hf_types), None)


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original: int) -> list[float]:
    """Llama 3's rotary scaling as a divisor per frequency, computed as llama.cpp's converter writes it to a GGUF
    (rope_freqs.weight): high frequencies kept, low ones divided by ``factor``, the band between smoothed."""
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors
