"""GGUFs with the shapes of the small models people pick, and random weights, for speed comparisons beside
llama.cpp on the same files (their answers are noise): Qwen2.5-0.5B (``qwen_shape``), Qwen3-0.6B, Gemma-3-1B,
Llama-3.2-1B, SmolLM3-3B and Phi-3.5-mini. Each has its architecture's block as llama.cpp's converter writes it
(Qwen3's q/k norms, Gemma 3's norms after attention and MLP and its 512 window on five layers of six, Llama 3.2's
``rope_freqs`` scaling, Phi-3's fused q/k/v and gate/up), a tied token table (Phi's own output layer), and the
bundled SmolLM2's tokenizer and chat template padded with [PADn] tokens to the model's vocabulary size (Phi's
cut to its 32k, with Phi-3's special tokens that llama.cpp looks up: ``vocabulary``).

``python -m bench.model_shapes NAME [KIND]`` writes ``data/bench-models/NAME-KIND.gguf`` (F16 with the ``gguf``
package; any other kind, Q4_K_M by default, made from it by llama.cpp's ``llama-quantize`` from
``LLAMA_SERVER``'s folder or ``LLAMA_QUANTIZE``) and prints its path; ``ensure(name, kind, folder, quantize)``
gives the file, built once.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    arch: str  # GGUF's general.architecture
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    context: int = 32768
    window: int = 0  # gemma3: the windowed layers' span
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low, high, original context


SHAPES = {
    "qwen2.5-0.5b": ModelShape("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e6, 1e-6),
    "qwen3-0.6b": ModelShape("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e6, 1e-6, context=40960),
    "gemma3-1b": ModelShape("gemma3", 262144, 1152, 6912, 26, 4, 1, 256, 1e6, 1e-6, window=512),
    "llama3.2-1b": ModelShape("llama", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5, context=131072,
                              llama3_rope=(32.0, 1.0, 4.0, 8192)),
    # every fourth layer without rotary positions (llama.cpp fixes it for the architecture: nothing in the file)
    "smollm3-3b": ModelShape("smollm3", 128256, 2048, 11008, 36, 16, 4, 128, 5e6, 1e-6, context=65536),
    # fused q/k/v and gate/up, its own output layer; Phi-3-mini-4k's context (no LongRoPE factors to write)
    "phi3.5-mini": ModelShape("phi3", 32064, 3072, 8192, 32, 32, 32, 96, 10000.0, 1e-5, context=4096),
}


def byte_level_alphabet() -> list[str]:
    """The 256 characters a byte-level BPE vocabulary writes bytes as (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


# Phi-3's own special tokens (its SentencePiece vocabulary's first three), which llama.cpp looks up by name in a
# file whose general.name says Phi-3 ("phi3", "phi-3": it strips the spaces after special tokens as Phi's tokenizer
# does) and refuses the file without ("error loading model vocabulary: unordered_map::at"); <|endoftext|> too,
# which the bundled tokenizer has
PHI3_SPECIALS = ("<unk>", "<s>", "</s>")
NORMAL, CONTROL = 1, 3  # GGUF's token types: an ordinary token, a special one (gguf.TokenType)


def vocabulary(shape: ModelShape, tokens: list[str], types: list[int], merges: list[str]) -> tuple[list, list, list]:
    """The bundled tokenizer's tokens, their types and merges cut or padded to ``shape``'s vocabulary: padded with
    [PADn] tokens; cut (Phi's 32k) to the first tokens with every byte's token kept among them (llama.cpp looks each
    up) and Phi-3's special tokens (``PHI3_SPECIALS``) in place of the last ones, and only the merges that make
    kept tokens from kept tokens."""
    s = shape
    if s.vocab < len(tokens):
        everything = tokens
        tokens, types = tokens[:s.vocab], types[:s.vocab]
        alphabet = set(byte_level_alphabet())
        missing = [t for t in everything[s.vocab:] if t in alphabet]  # llama.cpp looks every byte's token up
        specials = [t for t in PHI3_SPECIALS if t not in tokens] if s.arch == "phi3" else []
        tail = len(missing) + len(specials)
        if tail:
            tokens[-tail:] = specials + missing
            types[-tail:] = [CONTROL] * len(specials) + [NORMAL] * len(missing)
        kept = set(tokens)
        merges = [m for m in merges if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), s.vocab)]
    # ordinary tokens, as a real model's vocabulary is (user-defined ones are added tokens to a tokenizer: 213k of
    # them made transformers' tokenizer take 9 s more to load than the model's own 262k tokens do)
    types = types + [NORMAL] * (s.vocab - len(types))
    return tokens, types, merges


def write_f16(shape: ModelShape, target: Path, name: str) -> Path:
    import gguf
    import numpy as np

    from chat.engine.model.architecture import llama3_factors
    from chat.engine.model.loader import bundled_gguf

    src = gguf.GGUFReader(str(bundled_gguf()))

    def strings(key: str) -> list[str]:
        field = src.fields[key]
        return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]

    s = shape
    kinds = src.fields["tokenizer.ggml.token_type"]
    tokens, types, merges = vocabulary(s, strings("tokenizer.ggml.tokens"),
                                       [int(kinds.parts[i][0]) for i in kinds.data], strings("tokenizer.ggml.merges"))
    tmp = target.with_name(target.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), s.arch)
    w.add_name(name)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    if s.head_dim != s.hidden // s.heads:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    if s.arch != "qwen2":
        w.add_rope_dimension_count(s.head_dim)
    if s.window:
        w.add_sliding_window(s.window)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(strings("tokenizer.chat_template")[0])
    rng = np.random.default_rng(0)

    def rand(*dims: int):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int):
        return np.ones(n, np.float32)

    w.add_tensor("token_embd.weight", rand(s.vocab, s.hidden))
    if s.arch == "phi3":  # an output layer of its own (the others' are tied to the token table)
        w.add_tensor("output.weight", rand(s.vocab, s.hidden))
    if s.llama3_rope:
        factor, low, high, original = s.llama3_rope
        w.add_tensor("rope_freqs.weight", np.array(llama3_factors(s.rope_theta, s.head_dim, factor, low, high,
                                                                  original), dtype=np.float32))
    w.add_tensor("output_norm.weight", ones(s.hidden))
    for i in range(s.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(s.hidden))
        w.add_tensor(p + "ffn_norm.weight", ones(s.hidden))
        qkv = (("attn_q", s.heads * s.head_dim), ("attn_k", s.kv_heads * s.head_dim),
               ("attn_v", s.kv_heads * s.head_dim))
        if s.arch == "phi3":
            w.add_tensor(p + "attn_qkv.weight", rand(sum(rows for _, rows in qkv), s.hidden))
            qkv = ()
        for part, rows in qkv:
            w.add_tensor(p + part + ".weight", rand(rows, s.hidden))
            if s.arch == "qwen2":
                w.add_tensor(p + part + ".bias", np.zeros(rows, np.float32))
        if s.arch in ("qwen3", "gemma3"):
            w.add_tensor(p + "attn_q_norm.weight", ones(s.head_dim))
            w.add_tensor(p + "attn_k_norm.weight", ones(s.head_dim))
        if s.arch == "gemma3":  # llama.cpp's converter writes Gemma's norms as 1 + w
            w.add_tensor(p + "post_attention_norm.weight", ones(s.hidden))
            w.add_tensor(p + "post_ffw_norm.weight", ones(s.hidden))
        w.add_tensor(p + "attn_output.weight", rand(s.hidden, s.heads * s.head_dim))
        if s.arch == "phi3":  # gate rows, then up rows
            w.add_tensor(p + "ffn_up.weight", rand(2 * s.ffn, s.hidden))
        else:
            w.add_tensor(p + "ffn_gate.weight", rand(s.ffn, s.hidden))
            w.add_tensor(p + "ffn_up.weight", rand(s.ffn, s.hidden))
        w.add_tensor(p + "ffn_down.weight", rand(s.hidden, s.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(target)
    return target


def ensure(name: str, kind: str, folder: Path, quantize: str | None, stem: str | None = None) -> Path:
    """``name``'s file in ``kind`` (F16, Q8_0, Q4_0, Q4_K_M, ...), built once into ``folder`` as ``stem-kind.gguf``
    (``quantize``: llama-quantize, needed for any kind but F16)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = stem or name
    f16 = folder / f"{stem}-F16.gguf"
    if not f16.exists():
        write_f16(SHAPES[name], f16, f"{name}-shape-random")
    if kind == "F16":
        return f16
    target = folder / f"{stem}-{kind}.gguf"
    if not target.exists():
        if not quantize:
            raise RuntimeError(f"making the {kind} file needs llama-quantize (LLAMA_SERVER's folder has none)")
        tmp = target.with_name(target.name + ".tmp")
        subprocess.run([quantize, str(f16), str(tmp), kind], check=True, capture_output=True)
        tmp.rename(target)
    return target


def quantizer() -> str | None:
    """llama-quantize: ``LLAMA_QUANTIZE``, or beside ``LLAMA_SERVER``."""
    if os.environ.get("LLAMA_QUANTIZE"):
        return os.environ["LLAMA_QUANTIZE"]
    server = os.environ.get("LLAMA_SERVER")
    found = Path(server).with_name("llama-quantize") if server else None
    return str(found) if found and found.exists() else None


if __name__ == "__main__":
    from .server import ROOT
    print(ensure(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "Q4_K_M", ROOT / "data" / "bench-models",
                 quantizer()))
