"""In-process limit: a plain greedy generation and a raw forward loop, on a worker thread.

Both run what the server runs: the engine's own decoder (``chat/engine/model/decoder.py``, int4 or dense
weights as ``CHAT_QUANT`` makes them, after the idle chores that add the dense copies and the
crossovers), with no batching, scheduling, sampling or streaming around it; for a model the own
decoder does not cover, transformers' ``generate`` and forward.

Run as ``python -m bench.inprocess --prompt TEXT --tokens N --reps R --batches 1,8,16``; prints
one JSON object. With ``--serve`` it loads once and times one generation per request on stdin.
The main thread stays torch-free, as in the server.
The model is loaded with the server's own loader and settings (same weights, dtype, threads),
and the prompt goes through the same chat template with the same system prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def decoder_steps(torch, loaded, ids: list, batch: int, steps: int, clock=None) -> list[int]:
    """Greedy tokens of ``batch`` copies of ``ids`` on the engine's own decoder: prefill, then
    ``steps`` decode steps; ``clock()`` after the prefill and after each step. Returns the first
    row's tokens."""
    decoder = loaded.decoder
    kv = decoder.cache(batch, len(ids) + steps + 8)
    kv.reserve(len(ids))
    kv.mask[:batch, :len(ids)] = 1
    logits = decoder(torch.tensor([ids] * batch), kv, torch.arange(len(ids))[None].expand(batch, -1))
    kv.length = len(ids)
    tokens = []
    for i in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(int(token[0, 0]))
        if clock:
            clock()
        kv.reserve(1)
        kv.mask[:batch, kv.length] = 1
        logits = decoder(token, kv, torch.full((batch, 1), len(ids) + i))
        kv.length += 1
    if clock:
        clock()
    return tokens


def raw_loop(torch, loaded, ids: list, batch: int, steps: int) -> dict:
    """A plain greedy forward loop at ``batch`` rows: this design's ceiling."""
    times = []
    with torch.inference_mode():
        if loaded.decoder is not None:
            decoder_steps(torch, loaded, ids, batch, steps + 3, lambda: times.append(time.perf_counter()))
            times = [b - a for a, b in zip(times, times[1:])]
        else:
            from transformers import DynamicCache
            model, cache = loaded.model, DynamicCache()
            out = model(input_ids=torch.tensor([ids] * batch), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps + 3):
                started = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - started)
    step = statistics.median(times[3:])  # the first steps warm this batch size's kernels
    return {"batch": batch, "step_ms": step * 1000, "tok_s": batch / step}


def setup(prompt_text: str):
    """(torch, the loaded model, prompt ids, ``once(n)``: one timed greedy generation of exactly n new
    tokens, the first from the prefill)."""
    import torch
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    from chat.config import Settings
    from chat.engine.core import prompt
    from chat.engine.model import loader

    hf_logging.set_verbosity_error()

    class Clock(BaseStreamer):
        """Timestamps of every ``put``: the prompt first, then each new token."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    settings = Settings.from_env()
    loaded = loader.load(settings)
    for _ in loader.finish(loaded, settings):  # what the engine does while idle after start-up
        pass
    messages = [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": prompt_text}]
    ids = prompt.render(loaded.tokenizer, messages)
    input_ids = torch.tensor([ids], device=loaded.device)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else min(loaded.eos_ids)

    def once(n: int) -> dict:
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            if loaded.decoder is not None:
                clock.put(None)  # the prompt, as generate's streamer sees it first
                decoder_steps(torch, loaded, ids, 1, n - 1, lambda: clock.put(None))
                new = n
            else:
                out = loaded.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                            max_new_tokens=n, min_new_tokens=n, streamer=clock, pad_token_id=pad)
                new = out.shape[1] - len(ids)
        end = time.perf_counter()
        first, last = clock.times[1], clock.times[-1]
        return {"prefill_s": first - start, "total_s": end - start, "tokens": new,
                "tok_s": (new - 1) / (last - first) if new > 1 and last > first else 0.0}

    once(8)  # warm-up, not counted

    def prefill(text: str) -> dict:
        """Seconds to prefill [system, user ``text``] alone (the engine's own decoder, or a forward)."""
        prompt_ids = prompt.render(loaded.tokenizer, [{"role": "system", "content": settings.system_prompt},
                                                      {"role": "user", "content": text}])
        with torch.inference_mode():
            start = time.perf_counter()
            if loaded.decoder is not None:
                kv = loaded.decoder.cache(1, len(prompt_ids) + 8)
                kv.reserve(len(prompt_ids))
                kv.mask[0, :len(prompt_ids)] = 1
                loaded.decoder(torch.tensor([prompt_ids]), kv, torch.arange(len(prompt_ids))[None])
            else:
                loaded.model(input_ids=torch.tensor([prompt_ids]), logits_to_keep=1)
            return {"prefill_s": time.perf_counter() - start, "prompt_tokens": len(prompt_ids)}

    once.prefill = prefill
    return torch, loaded, ids, once


def measure(prompt_text: str, tokens: int, reps: int, batches=(1, 8)) -> dict:
    """Load, warm up and time ``reps`` greedy generations of exactly ``tokens`` new tokens."""
    torch, loaded, ids, once = setup(prompt_text)
    runs = [once(tokens) for _ in range(reps)]
    raw = [raw_loop(torch, loaded, ids, b, tokens) for b in batches]
    return {"raw": {str(r["batch"]): r for r in raw}, "model": loaded.name,
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "weights": loaded.weights,
            "device": str(loaded.device), "torch_threads": torch.get_num_threads(),
            "load_s": loaded.load_s, "prompt_tokens": len(ids), "runs": runs,
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "prefill_s": statistics.median(r["prefill_s"] for r in runs)}


def serve(prompt_text: str) -> None:
    """Load once, print ``{"ready": true}``, then for each stdin line ``{"tokens": N}`` time one
    generation (``{"prefill": TEXT}``: one prefill of that message) and print it: the reference
    interleaved with the server's own runs (``bench.run``)."""
    torch, loaded, ids, once = setup(prompt_text)
    print(json.dumps({"ready": True, "prompt_tokens": len(ids)}), flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        answer = once.prefill(asked["prefill"]) if "prefill" in asked else once(asked["tokens"])
        print(json.dumps(answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", default="1,8", help="batch sizes of the raw forward loop")
    parser.add_argument("--serve", action="store_true", help="answer timing requests on stdin (see serve)")
    args = parser.parse_args()
    result: dict = {}

    def work() -> None:
        try:
            if args.serve:
                serve(args.prompt)
                return
            result.update(measure(args.prompt, args.tokens, args.reps, [int(b) for b in args.batches.split(",")]))
        except Exception as exc:  # reported to the parent, which owns error handling
            result["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=work, name="bench-model")
    worker.start()
    worker.join()
    if result or not args.serve:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
