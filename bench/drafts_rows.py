"""Drafts beyond one row, measured: the server with drafts (``CHAT_DRAFT=ngram``) and without (``off``), both
started at once and asked in turn (on, off, off, on, ...), so a shared box's load falls on both alike, at 1, 2 and 8
streams sent together, on four workloads: "story" (a short story about a dragon), "chat" (an explanation),
"chinese" (the story asked in Chinese) and "edit" (quoting a ~300-token attachment with a small change: where
drafts pay). Titles off on both (no background work between requests); ``CHAT_THREADS`` as the environment says.
Each cell: the aggregate tokens per second (all streams' tokens over the wall time from the first send to the last
end), median of ``--reps``; the drafts' counts from ``/readyz``.
Writes ``bench/results/drafts_rows.json`` (``--name``)::

    CHAT_MODEL=/tmp/realqwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf .venv/bin/python -m bench.drafts_rows
    ... --temperature 0.7 --top-p 0.9   # every request sampled (seeded)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

from . import phases, workloads
from .server import BenchServer, Client, http_get

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["Ember", "Sol", "Pip", "Vex", "Rune", "Ash", "Bram", "Cleo"]
WORKLOADS = {
    "story": lambda i: f"Write a short story about a dragon named {NAMES[i % len(NAMES)]}.",
    "chat": lambda i: f"Explain how {['a refrigerator', 'a bicycle', 'a rainbow', 'a vaccine'][i % 4]} works.",
    "chinese": lambda i: f"写一个关于一条名叫{NAMES[i % len(NAMES)]}的龙的短篇故事。",
    "edit": lambda i: workloads.edit_prompt(),
}


def _round(url: str, n: int, prompt, tokens: int, params: dict, timeout: float, tag: str) -> dict:
    clients = [Client(url, timeout=timeout) for _ in range(n)]
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def work(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = clients[i].request(f"{tag}-{i}", prompt(i), {**params, "max_new_tokens": tokens,
                                                                         "seed": i + 1})
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        for c in clients:
            c.close()
    bad = [r for r in results if not isinstance(r, dict)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} streams failed: {bad[0]!r}")
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    return {"aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
            "stream_tok_s_p50": statistics.median(r["tok_s"] for r in results)}


def _counts(port: int) -> dict:
    ready = json.loads(http_get(port, "/readyz")[1])
    return {k: ready.get(k, 0) for k in ("draft_steps", "drafted_tokens", "draft_accepted_tokens")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 8])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--edit-tokens", type=int, default=300, help="new tokens per edit request")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--name", default="drafts_rows")
    args = parser.parse_args(argv)
    params = {"temperature": args.temperature, "top_p": args.top_p}
    load_before = os.getloadavg()
    out: dict = {"args": vars(args), "loadavg_before": load_before, "cells": {}}
    with tempfile.TemporaryDirectory(prefix="chat-bench-rows-") as tmp:
        servers = {}
        try:
            for mode in ("ngram", "off"):
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "CHAT_DRAFT": mode, "CHAT_TITLES": "0",
                       "CHAT_DATA_DIR": str(Path(tmp) / mode), "CHAT_MAX_BATCH": "16", "CHAT_CONTEXT_TOKENS": "4096",
                       "CHAT_RATE_LIMIT_PER_MIN": "0", "CHAT_MAX_CONNECTIONS_PER_IP": "0", "CHAT_WORKERS": "1",
                       "CHAT_RATE_LIMIT_PER_IP_PER_MIN": "0", "CHAT_MAX_ACTIVE_PER_IP": "0",
                       "CHAT_GRACEFUL_TIMEOUT_S": "5"}
                env.setdefault("CHAT_CACHE_DIR", str(ROOT / "data" / "model-cache"))
                srv = servers[mode] = BenchServer(Path(tmp) / f"srv-{mode}", env)
                srv.start(timeout=args.timeout)
                phases.wait_finished(srv, timeout=args.timeout)  # the C++ step built and checked
            for mode, srv in servers.items():  # a warm-up each
                _round(srv.ws_url, 1, WORKLOADS["story"], 16, params, args.timeout, f"warm-{mode}")
            for name in args.workloads:
                tokens = args.edit_tokens if name == "edit" else args.tokens
                for n in args.streams:
                    runs: dict = {"ngram": [], "off": []}
                    before = _counts(servers["ngram"].port)
                    for rep in range(args.reps):
                        for mode in (("ngram", "off") if rep % 2 == 0 else ("off", "ngram")):
                            runs[mode].append(_round(servers[mode].ws_url, n, WORKLOADS[name], tokens, params,
                                                     args.timeout, f"{name}-{n}-{rep}-{mode}"))
                    after = _counts(servers["ngram"].port)
                    cell = {mode: statistics.median(r["aggregate_tok_s"] for r in rs) for mode, rs in runs.items()}
                    cell["ratio"] = cell["ngram"] / cell["off"]
                    cell["stream_tok_s_p50"] = {mode: statistics.median(r["stream_tok_s_p50"] for r in rs)
                                                for mode, rs in runs.items()}  # each stream's own pace
                    cell["drafts"] = {k: after[k] - before[k] for k in after}
                    cell["loadavg"] = os.getloadavg()[0]
                    out["cells"][f"{name}@{n}"] = cell
                    print(f"  {name} x{n}: drafts {cell['ngram']:.1f} tok/s, off {cell['off']:.1f} "
                          f"({cell['ratio']:.2f}x; a stream's pace {cell['stream_tok_s_p50']}) {cell['drafts']} "
                          f"load {cell['loadavg']:.1f}", file=sys.stderr,
                          flush=True)
        except Exception:
            for srv in servers.values():
                print(srv.log()[-4000:], file=sys.stderr)
            raise
        finally:
            for srv in servers.values():
                srv.stop()
    out["loadavg_after"] = os.getloadavg()
    path = ROOT / "bench" / "results" / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
