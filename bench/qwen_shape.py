"""A GGUF with Qwen2.5-0.5B-Instruct's shape and random weights, for speed comparisons on the model class
the product is for (its answers are noise): 24 layers, hidden 896, 14 query / 2 key-value heads of 64, MLP
4864, q/k/v biases, rope theta 1e6, a tied 151,936-row token table; the tokenizer and chat template are the
bundled SmolLM2's, padded with [PADn] tokens to Qwen's vocabulary size.

``python -m bench.qwen_shape OUT.gguf`` writes the F16 file (with the ``gguf`` package); ``ensure(kind, folder,
quantize)`` gives the file in ``kind`` (F16, Q8_0, Q4_0, Q4_K_M, ...), made with llama.cpp's ``llama-quantize``
from the F16 one, each kept in ``folder`` after its first build.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 151936, 896, 4864, 24, 14, 2


def write_f16(target: Path) -> Path:
    import gguf
    import numpy as np

    from chat.engine.model.loader import bundled_gguf

    src = gguf.GGUFReader(str(bundled_gguf()))

    def strings(key: str) -> list[str]:
        field = src.fields[key]
        return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    kinds = src.fields["tokenizer.ggml.token_type"]
    types = [int(kinds.parts[i][0]) for i in kinds.data]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    types += [gguf.TokenType.USER_DEFINED] * (VOCAB - len(types))
    dim = HIDDEN // HEADS
    tmp = target.with_name(target.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_name("qwen2.5-0.5b-shape-random")
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
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

    def rand(*shape: int):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, rows in (("attn_q", HEADS * dim), ("attn_k", KV_HEADS * dim), ("attn_v", KV_HEADS * dim)):
            w.add_tensor(p + name + ".weight", rand(rows, HIDDEN))
            w.add_tensor(p + name + ".bias", np.zeros(rows, np.float32))
        w.add_tensor(p + "attn_output.weight", rand(HIDDEN, HEADS * dim))
        w.add_tensor(p + "ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(target)
    return target


def ensure(kind: str, folder: Path, quantize: str | None) -> Path:
    """The Qwen-shaped file in ``kind``, built once into ``folder`` (``quantize``: llama-quantize, needed
    for any kind but F16)."""
    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / "qwen-shape-F16.gguf"
    if not f16.exists():
        write_f16(f16)
    if kind == "F16":
        return f16
    target = folder / f"qwen-shape-{kind}.gguf"
    if not target.exists():
        if not quantize:
            raise RuntimeError(f"making the {kind} file needs llama-quantize (LLAMA_SERVER's folder has none)")
        tmp = target.with_name(target.name + ".tmp")
        subprocess.run([quantize, str(f16), str(tmp), kind], check=True, capture_output=True)
        tmp.rename(target)
    return target


if __name__ == "__main__":
    print(write_f16(Path(sys.argv[1])))
