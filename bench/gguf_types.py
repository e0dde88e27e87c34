"""Every common GGUF type through this engine's decode path, beside ``llama-perplexity`` on the same file.

``python -m bench.gguf_types`` re-quantizes the bundled model (real weights) with llama.cpp's
``llama-quantize --allow-requantize`` into each type, then takes the perplexity of a fixed text both ways,
as ``llama-perplexity`` computes it: the tokens cut into chunks of ``--ctx``, each chunk evaluated from its
start (its first token replaced by BOS where the model adds one), and the second half of each chunk scored.
Here every token goes through a decode step (the int4 products and the C++ step, as the server runs them).
Needs ``LLAMA_SERVER`` naming a llama.cpp build with ``llama-quantize`` and ``llama-perplexity`` beside it
(``../shared/peers/build-llamacpp.sh``); prints one JSON object and a markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .server import ROOT

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"]
TEXT = (
    "The history of bread goes back at least thirty thousand years. The first breads were flat, made from crushed "
    "grains and water and cooked on hot stones. When people began to farm wheat and barley, bread became a daily "
    "food. In ancient Egypt bakers learned that dough left to stand would rise, because wild yeasts in the air "
    "fed on the sugars in the flour. Greek and Roman cities had public bakeries, and a baker's work was so valued "
    "that some were given the rights of citizens.\n\n"
    "A river begins as rain or melting snow high in the hills. Small streams run together into brooks, and the "
    "brooks join into a river that grows wider as it flows toward the sea. Along the way the water carries sand "
    "and small stones, which it drops where it slows down, building banks, islands and at last a wide delta. "
    "People have always settled by rivers, for water to drink, fish to eat, fields to grow crops in and a road "
    "for boats to carry their goods.\n\n"
    "The first mechanical clocks appeared in the towers of European churches about seven hundred years ago. They "
    "had no faces and no hands: they rang a bell every hour so that monks would know when to pray. Later clocks "
    "gained a dial, then a minute hand, and in the seventeenth century the pendulum made them accurate to a few "
    "seconds a day. Sailors needed even better clocks to find their position at sea, and a carpenter named John "
    "Harrison spent most of his life building one that kept time on a rolling ship.\n\n"
    "Honey bees live in colonies of tens of thousands. A single queen lays the eggs, the male drones exist only "
    "to mate, and the female workers do everything else: they clean the hive, feed the young, build the wax "
    "comb, guard the entrance and fly out to gather nectar and pollen. A worker that finds a rich patch of "
    "flowers returns and dances on the comb, and the angle and length of her dance tell the others which way to "
    "fly and how far to go.")


def quantize(tool: str, kind: str, folder: Path) -> Path:
    from chat.engine.model.loader import bundled_gguf
    target = folder / f"smollm2-{kind}.gguf"
    if not target.exists():
        tmp = target.with_name(target.name + ".tmp")
        subprocess.run([tool, "--allow-requantize", str(bundled_gguf()), str(tmp), kind], check=True,
                       capture_output=True)
        tmp.rename(target)
    return target


def ours(path: Path, ctx: int) -> dict:
    """This engine's perplexity of TEXT on ``path``, and what its products were."""
    import torch

    from chat.config import Settings
    from chat.engine.model import loader

    settings = dataclasses.replace(Settings.from_env(), model=str(path))
    with torch.inference_mode():
        loaded = loader.load(settings)
        for _ in loader.finish(loaded, settings):
            pass
        tokenizer, decoder = loaded.tokenizer, loaded.decoder
        ids = tokenizer.encode(TEXT, add_special_tokens=False, split_special_tokens=True)
        bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
        if bos is not None:
            ids = [bos, *ids]
        total, count = 0.0, 0
        first = ctx // 2
        for c in range(len(ids) // ctx):
            chunk = ids[c * ctx:(c + 1) * ctx]
            if bos is not None:
                chunk[0] = bos
            kv = decoder.cache(1, ctx + 8)
            for j in range(ctx - 1):
                kv.open(1)
                logits = decoder(torch.tensor([[chunk[j]]]), kv, torch.tensor([[j]]))
                kv.advance(1)
                if j >= first:
                    total -= float(torch.log_softmax(logits[0].double(), dim=-1)[chunk[j + 1]])
                    count += 1
    return {"perplexity": math.exp(total / count), "scored": count, "weights": loaded.weights,
            "formats": decoder.formats(), "decode": "native" if decoder.native else "torch"}


def theirs(tool: str, path: Path, ctx: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(TEXT)
    try:
        out = subprocess.run([tool, "-m", str(path), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", "2"],
                             capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity said: {(out.stdout + out.stderr)[-1500:]}")
    return float(found.group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_types", description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--text", type=Path, help="a text file to score instead of the built-in paragraphs (more "
                        "tokens: a tighter comparison)")
    parser.add_argument("--models", type=Path, default=ROOT / "data" / "bench-models")
    parser.add_argument("--file", type=Path, action="append", help="score this GGUF as it is instead of the "
                        "re-quantized bundled model (repeatable: e.g. a real Qwen2.5 file)")
    args = parser.parse_args(argv)
    if args.text:
        global TEXT
        TEXT = args.text.read_text()
    server = os.environ.get("LLAMA_SERVER")
    if not server:
        raise SystemExit("LLAMA_SERVER must name a llama.cpp build (llama-quantize, llama-perplexity beside it)")
    tools = Path(server).parent
    args.models.mkdir(parents=True, exist_ok=True)
    rows = []
    files = [(file.name, file) for file in args.file or ()]
    for kind, path in files or [(kind, None) for kind in args.types.split(",")]:
        path = path or quantize(str(tools / "llama-quantize"), kind, args.models)
        mine: dict = {}
        worker = threading.Thread(target=lambda out=mine, file=path: out.update(ours(file, args.ctx)))  # not main
        worker.start()
        worker.join()
        reference = theirs(str(tools / "llama-perplexity"), path, args.ctx)
        rows.append({"type": kind, **mine, "llama_perplexity": reference, "ratio": mine["perplexity"] / reference})
        print(f"[types] {kind}: ours {mine['perplexity']:.4f}, llama.cpp {reference:.4f}", file=sys.stderr, flush=True)
    lines = ["| type | ours | llama-perplexity | ratio | products (decode) |", "|---|---|---|---|---|"]
    lines += [f"| {r['type']} | {r['perplexity']:.3f} | {r['llama_perplexity']:.3f} | {r['ratio']:.4f} | "
              + ", ".join(f"{k} {v}" for k, v in r["formats"].items()) + " |" for r in rows]
    print(json.dumps(rows))
    print("\n".join(lines))
    return 0 if all(abs(r["ratio"] - 1) <= 0.01 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
