"""A GGUF with Qwen2.5-0.5B-Instruct's shape and random weights, for speed comparisons on the model class
the product is for (its answers are noise): 24 layers, hidden 896, 14 query / 2 key-value heads of 64, MLP
4864, q/k/v biases, rope theta 1e6, a tied 151,936-row token table; the tokenizer and chat template are the
bundled SmolLM2's, padded with [PADn] tokens to Qwen's vocabulary size (``model_shapes``' "qwen2.5-0.5b").

``python -m bench.qwen_shape OUT.gguf`` writes the F16 file (with the ``gguf`` package); ``ensure(kind, folder,
quantize)`` gives the file in ``kind`` (F16, Q8_0, Q4_0, Q4_K_M, ...), made with llama.cpp's ``llama-quantize``
from the F16 one, each kept in ``folder`` after its first build.
"""
from __future__ import annotations

import sys
from pathlib import Path

from . import model_shapes

NAME = "qwen2.5-0.5b"


def write_f16(target: Path) -> Path:
    return model_shapes.write_f16(model_shapes.SHAPES[NAME], target, "qwen2.5-0.5b-shape-random")


def ensure(kind: str, folder: Path, quantize: str | None) -> Path:
    """The Qwen-shaped file in ``kind``, built once into ``folder`` (``quantize``: llama-quantize, needed
    for any kind but F16)."""
    return model_shapes.ensure(NAME, kind, folder, quantize, stem="qwen-shape")


if __name__ == "__main__":
    print(write_f16(Path(sys.argv[1])))
