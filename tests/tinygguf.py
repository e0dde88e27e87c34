"""Build a small random Llama (or Qwen2, with q/k/v biases) GGUF with the bundled model's tokenizer and chat
template, for fast tests of the engine's direct GGUF path: its layers in one block type (Q4_1 by default) or
in ``MIX``, a type per matrix as llama.cpp's K-quant mixes have them; the tied token table Q8_0; norms F32."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "data" / "test-cache"

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


# LongRoPE as Phi-3.5/4-mini's config has it, shortened: a context 8 times the original one (the tests stay within
# the original: transformers switches a sequence past it to the long factors, the engine keeps the short ones)
LONGROPE = {"original_max_position_embeddings": 256, "max_position_embeddings": 2048}


def longrope_factors(rotary: int, which: str) -> list[float]:
    """Made-up factors of LongRoPE's shape: 1 at the high frequencies, growing towards the low ones (the long ones
    further)."""
    top = 6.0 if which == "long" else 2.0
    n = rotary // 2
    return [1.0 + (top - 1.0) * i / max(n - 1, 1) for i in range(n)]


def longrope_attention() -> float:
    """The attention factor llama.cpp's converter writes (and transformers computes): sqrt(1 + ln(s) / ln(orig))."""
    import math
    orig, longest = LONGROPE["original_max_position_embeddings"], LONGROPE["max_position_embeddings"]
    return math.sqrt(1 + math.log(longest / orig) / math.log(orig))


# qtype "mix": each matrix of a layer in its own type (K-quants need 256 columns: hidden 256).
MIX = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
       "ffn_up": "Q8_0", "ffn_down": "Q4_K"}


def tiny_gguf(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, qtype: str = "Q4_1",
              seed: int = 0, arch: str = "llama", head: str = "Q8_0", head_dim: int | None = None,
              rope_scaling: dict | None = None, template: bool | str = True, window: int = 0, rotary: int = 0,
              longrope: bool = False) -> Path:
    """A .gguf file, built once and cached: every attention and MLP matrix in ``qtype`` (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, or "mix": ``MIX``), the token table (shared with the output layer) in ``head``. Weights
    are wide (std 0.2), so greedy answers have no near-ties. ``arch`` qwen2 adds q/k/v biases, qwen3 per-head
    q/k norms; ``head_dim`` other than hidden / heads sets the heads' size apart (Qwen3's are wider);
    ``rope_scaling`` (transformers' llama3 rope parameters) writes its factors as llama.cpp's converter does
    (rope_freqs.weight); ``template`` False leaves the chat template out (a base model), a string is the chat
    template written instead of the bundled model's (a thinking model's, tests/templates/). ``arch`` gemma3 has
    q/k norms, norms after the attention and the MLP, a GELU MLP and ``window``-wide attention on five layers of
    six (its norms stored as 1 + w, as llama.cpp's converter writes them). ``arch`` smollm3 is llama's layout (the
    engine leaves every fourth layer without rotary positions, as llama.cpp does); phi3 fuses q/k/v (attn_qkv)
    and gate/up (ffn_up), with rotary positions over ``rotary`` of each head (0: all) and, with ``longrope``,
    LongRoPE's factors (rope_factors_long/short, ``LONGROPE``) and attention factor as llama.cpp writes them."""
    sized = f"-d{head_dim}" if head_dim else ""
    if rope_scaling:
        sized += "-rope" + "-".join(str(rope_scaling[k]) for k in sorted(rope_scaling) if k != "rope_type")
    sized += ("" if template else "-base") + (f"-w{window}" if window else "")
    if isinstance(template, str):
        import hashlib
        sized += "-t" + hashlib.sha256(template.encode()).hexdigest()[:10]
    sized += (f"-r{rotary}" if rotary else "")
    sized += f"-longrope{LONGROPE['original_max_position_embeddings']}" if longrope else ""
    target = CACHE / f"tiny-{arch}-{qtype}-{head}-h{hidden}{sized}-l{layers}-s{seed}.gguf"
    if target.is_file():
        return target
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    from chat.engine.model.loader import bundled_gguf

    source = GGUFReader(str(bundled_gguf()))
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[qtype] if qtype != "mix" else None
    head_dim = head_dim or hidden // heads
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    CACHE.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(tmp), arch)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hidden * 2)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if window:
        w.add_sliding_window(window)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32(f"{arch}.rope.dimension_count", rotary or head_dim)
    if longrope:
        w.add_rope_scaling_orig_ctx_len(LONGROPE["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(longrope_attention())
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    for key in TOKENIZER_KEYS:
        if key == "tokenizer.chat_template" and not template:
            continue
        if key == "tokenizer.chat_template" and isinstance(template, str):
            w.add_string(key, template)
            continue
        field = source.fields[key]
        value = field.contents()
        kind_of = field.types[0]
        if key.endswith(("tokens", "merges")):
            w.add_array(key, value)
        elif key.endswith("token_type"):
            w.add_array(key, [int(v) for v in value])
        elif kind_of.name == "STRING":
            w.add_string(key, value)
        elif kind_of.name == "BOOL":
            w.add_bool(key, bool(value))
        else:
            w.add_uint32(key, int(value))

    def matrix(name: str, rows: int, cols: int, qt=None) -> None:
        qt = qt or (GGMLQuantizationType[MIX[name.split(".")[-2]]] if qtype == "mix" else kind)
        if qt.name.endswith("_K"):  # gguf-py cannot quantize these: random blocks with small scales
            w.add_tensor(name, k_blocks(qt, rows, cols), raw_dtype=qt)
            return
        data = rng.normal(0, 0.2, (rows, cols)).astype(np.float32)
        w.add_tensor(name, quants.quantize(data, qt), raw_dtype=qt)

    def k_blocks(qt, rows: int, cols: int):
        per, size = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}[qt.name]
        raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
        scale = (np.abs(rng.normal(0, 1, (rows, cols // per))) * (0.0008 if qt.name != "Q6_K" else 0.0002))
        halves = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
        if qt.name == "Q6_K":
            raw[:, :, 208:210] = halves  # d; the int8 sub-block scales stay random
        else:
            raw[:, :, 0:2] = halves  # d and dmin
            raw[:, :, 2:4] = halves
        return raw.reshape(rows, -1)

    def bias(name: str, size: int) -> None:
        w.add_tensor(name, rng.normal(0, 0.2, size).astype(np.float32))

    def norm(name: str, size: int = hidden) -> None:
        w.add_tensor(name, (1 + rng.normal(0, 0.1, size)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, GGMLQuantizationType[head])
    if rope_scaling:
        from chat.engine.model.architecture import llama3_factors
        r = rope_scaling
        w.add_tensor("rope_freqs.weight", np.array(llama3_factors(
            10000.0, head_dim, r["factor"], r["low_freq_factor"], r["high_freq_factor"],
            r["original_max_position_embeddings"]), dtype=np.float32))
    if longrope:
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight", np.array(longrope_factors(rotary or head_dim, which),
                                                                 dtype=np.float32))
    norm("output_norm.weight")
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        if arch == "phi3":  # fused, as llama.cpp's converter keeps Phi-3's own matrices
            matrix(p + "attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden)
        else:
            matrix(p + "attn_q.weight", heads * head_dim, hidden)
            matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
            matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            bias(p + "attn_q.bias", heads * head_dim)
            bias(p + "attn_k.bias", kv_heads * head_dim)
            bias(p + "attn_v.bias", kv_heads * head_dim)
        if arch in ("qwen3", "gemma3"):
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            norm(p + "post_attention_norm.weight")
            norm(p + "post_ffw_norm.weight")
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        if arch == "phi3":
            matrix(p + "ffn_up.weight", hidden * 4, hidden)  # gate rows, then up rows
        else:
            matrix(p + "ffn_gate.weight", hidden * 2, hidden)
            matrix(p + "ffn_up.weight", hidden * 2, hidden)
        matrix(p + "ffn_down.weight", hidden, hidden * 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(target)
    return target
