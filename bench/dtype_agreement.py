"""Greedy agreement of bfloat16 against float32 on ten prompts (the engine's dtype choice).

Run as ``python -m bench.dtype_agreement [--tokens N]``; prints a markdown table and
writes ``bench/results/dtype_agreement.json``. Torch runs on a worker thread only.
"""
from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
    "Name the largest planet in the solar system.",
    "Suggest a name for a friendly robot.",
]


def compare(tokens: int) -> list[dict]:
    """Greedy answers in both dtypes, with the length of their common token prefix."""
    import torch

    from bench.inprocess import decoder_steps
    from chat.config import Settings
    from chat.engine.core import prompt
    from chat.engine.model import loader

    answers = {}
    for dtype in ("float32", "bfloat16"):
        # Dense weights in both (CHAT_QUANT=off): this compares dtypes, bench/quality.py the int4 path.
        loaded = loader.load(Settings.from_env(dtype=dtype, quant="off"))
        outs = []
        for text in PROMPTS:
            ids = prompt.render(loaded.tokenizer, [{"role": "user", "content": text}])
            with torch.inference_mode():
                if loaded.decoder is not None:
                    new = decoder_steps(torch, loaded, ids, 1, tokens)
                    end = next((i for i, t in enumerate(new) if t in loaded.eos_ids), len(new))
                    outs.append(new[:end + 1])
                    continue
                out = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=tokens,
                                            pad_token_id=min(loaded.eos_ids))
            outs.append(out[0, len(ids):].tolist())
        answers[dtype] = (outs, loaded.tokenizer)
    rows = []
    tokenizer = answers["float32"][1]
    for text, a, b in zip(PROMPTS, answers["float32"][0], answers["bfloat16"][0]):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"prompt": text, "identical": a == b, "common_prefix_tokens": common,
                     "fp32_tokens": len(a), "bf16_tokens": len(b),
                     "fp32": tokenizer.decode(a, skip_special_tokens=True),
                     "bf16": tokenizer.decode(b, skip_special_tokens=True)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    result = {}
    worker = threading.Thread(target=lambda: result.update(rows=compare(args.tokens)))
    worker.start()
    worker.join()
    rows = result["rows"]
    out = Path(__file__).resolve().parent / "results" / "dtype_agreement.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=2, ensure_ascii=False))
    print("| prompt | identical | common prefix (tokens) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {'yes' if r['identical'] else 'no'} | "
              f"{r['common_prefix_tokens']} / {max(r['fp32_tokens'], r['bf16_tokens'])} |")
    same = sum(r["identical"] for r in rows)
    print(f"\n{same}/{len(rows)} greedy answers identical in bfloat16 and float32")


if __name__ == "__main__":
    main()
