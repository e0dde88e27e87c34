"""Build a small random Qwen2 model with the bundled model's tokenizer, for fast tests."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "data" / "test-cache"


def tiny_model_dir(name: str = "tiny-qwen2", hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A model folder (config, weights, tokenizer with chat template), built once and cached."""
    target = CACHE / f"{name}-h{hidden}-l{layers}-s{seed}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from chat.engine.model.loader import bundled_gguf, gguf_tokenizer
    tokenizer = gguf_tokenizer(bundled_gguf())  # the bundled model's, read from its GGUF
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         # a wide init gives peaked logits, so greedy answers have no near-ties
                         initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(target)
    return target


def tiny_phi_dir(hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A small random Phi model (LayerNorm, partial rotary, GELU, biases: not what the own decoder runs, so
    the engine runs transformers' forward), with the bundled model's tokenizer; built once and cached."""
    target = CACHE / f"tiny-phi-h{hidden}-l{layers}-s{seed}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    from chat.engine.model.loader import bundled_gguf, gguf_tokenizer
    tokenizer = gguf_tokenizer(bundled_gguf())
    torch.manual_seed(seed)
    config = PhiConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=8192, partial_rotary_factor=0.5, initializer_range=0.2,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = PhiForCausalLM(config)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(target)
    return target
