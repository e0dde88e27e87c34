"""``python -m bench.run``: measure the chat server against the real bundled model, in one run.

Phases: the in-process limit (plain ``generate`` and a raw forward loop at batch 1/8/16, in a
subprocess), start-up, one stream (greedy, then sampled), concurrency 1/2/4/8/16, /healthz
under load, cancel latency, a long prompt joining running streams, a long multi-turn
conversation, a huge /v1 request, resident memory. Writes ``latest.json``, ``latest.md`` and ``latest.png``
to ``bench/results/`` (or ``--out``) and prints the markdown.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from . import report, webtier
from .server import ROOT, BenchServer, Client, Sampler, http_get, http_post_json
from .stats import percentile

TOPICS = ["the history of the printing press", "how bridges carry heavy loads", "the life cycle of stars",
          "why the sea is salty", "how vaccines train the immune system", "the invention of the telephone",
          "how honey bees organise their hives", "the causes of the French Revolution",
          "how a car engine works", "the water cycle on Earth", "the rise of the Roman Empire",
          "how computers store numbers", "the migration of birds", "how volcanoes form",
          "the history of chess", "how trains changed the nineteenth century"]

NOTES = ["The committee met on a rainy Tuesday to review the budget for the new library wing.",
         "Three suppliers offered timber, and the cheapest one could deliver only in the spring.",
         "The architect insisted on large windows facing north so that the reading room stays cool.",
         "Volunteers counted 4,812 books that still need new labels before the move.",
         "A local school asked whether pupils could visit the archive once a month.",
         "The heating system is thirty years old and uses twice the energy of a modern one.",
         "Members disagreed about opening hours on Sundays, and the vote was postponed.",
         "The treasurer reported that donations rose by twelve percent compared with last year."]

MiB = 1024 * 1024


def essay_prompt(i: int) -> str:
    """A distinct prompt that asks for a long answer."""
    topic = TOPICS[i % len(TOPICS)]
    return (f"Write a long, detailed essay about {topic}. Explain where it comes from, how it works, "
            f"who was involved and why it matters today, with concrete examples in every paragraph.")


def notes_message(turn: int, tokens: int) -> str:
    """A user message of about ``tokens`` tokens: numbered meeting notes, then a question."""
    parts, i = [f"Here are my notes from meeting {turn}."], 0
    while sum(len(p) for p in parts) / 4.3 < tokens:
        parts.append(f"({turn}.{i + 1}) {NOTES[(turn + i) % len(NOTES)]}")
        i += 1
    return " ".join(parts) + " Summarise these notes in two sentences."


def params(max_new_tokens: int, seed: int = 1) -> dict:
    """Greedy, seeded generation parameters."""
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "seed": seed}


SAMPLED = {"temperature": 0.7, "top_p": 0.9}
RAW = ("1", "8", "16")  # batch sizes of the raw forward loop
LLAMA_CPP = [  # measured in issue 10 on a 2-core AMD EPYC with native bf16, same model as GGUF
    ("llama.cpp server, one stream tok/s", 153), ("llama.cpp server, 8 slots aggregate tok/s", 243),
    ("llama.cpp server, first token with 8 users ms", 49),
    ("raw transformers forward loop there, batch 8 tok/s", 240)]


def basic_machine() -> dict:
    """CPU, cores and Python, without asking torch (the web-tier phase needs no model)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def machine_facts(env: dict) -> dict:
    """CPU, cores, torch/transformers versions and threads, dtype, whether the weights cache is warm."""
    code = ("import json, torch, transformers\n"
            "from chat.engine import model as m\n"
            "from chat.config import Settings\n"
            "s = Settings.from_env()\n"
            "if s.threads:\n"
            "    torch.set_num_threads(s.threads)\n"
            "device = m.pick_device(s.device)\n"
            "warm = None\n"
            "if not s.model or s.model.endswith('.gguf'):\n"
            "    from pathlib import Path\n"
            "    gguf = Path(s.model).expanduser() if s.model else m.bundled_gguf()\n"
            "    warm = (m._gguf_cache_dir(gguf, s.model_cache_dir) / 'config.json').is_file()\n"
            "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,\n"
            "    'torch_threads': torch.get_num_threads(), 'device': str(device),\n"
            "    'dtype': str(m.pick_dtype(s.dtype, device)).removeprefix('torch.'), 'cache_warm': warm}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    facts = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}
    return {**basic_machine(), **facts}


def run_inprocess(env: dict, args) -> dict:
    """Plain ``generate`` in a fresh subprocess (model on a worker thread)."""
    cmd = [sys.executable, "-m", "bench.inprocess", "--prompt", essay_prompt(0), "--tokens", str(args.tokens),
           "--reps", str(args.inprocess_reps), "--batches", ",".join(RAW)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"in-process run failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def reference(res: dict) -> dict:
    """The in-process limit: the mean of its run before the server started and its run right after the
    single-stream phases, so a drift of the machine's speed between phases (±15 % on a shared VM)
    biases the ratios less. Raw loops and generate alike."""
    runs = [r for r in (res.get("inprocess"), res.get("inprocess_after")) if r and "error" not in r]
    if not runs:
        return {}

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    merged = {**runs[0], "tok_s": mean(r.get("tok_s") for r in runs),
              "prefill_s": mean(r.get("prefill_s") for r in runs)}
    merged["raw"] = {b: {key: mean((r.get("raw") or {}).get(b, {}).get(key) for r in runs)
                         for key in ("tok_s", "step_ms")} for b in runs[0].get("raw") or {}}
    return merged


def summarize(results: list[dict]) -> dict:
    """Medians and percentiles over finished requests."""
    ttfd = [r["ttfd_s"] for r in results]
    return {"n": len(results), "tokens": [r["tokens"] for r in results],
            "ttfd_p50_s": percentile(ttfd, 50), "ttfd_p95_s": percentile(ttfd, 95), "ttfd_max_s": max(ttfd),
            "tok_s_p50": percentile([r["tok_s"] for r in results], 50),
            "aggregate_tok_s_p50": percentile([r["tokens"] / (r["done"] - r["sent"]) for r in results], 50),
            "server_ttft_ms_p50": percentile([r["server_ttft_ms"] for r in results], 50)}


class Reference:
    """In-process ``generate`` in its own process, loaded once and timed on request, so each of the
    server's single-stream runs has a reference run right beside it (the VM's speed drifts)."""

    def __init__(self, env: dict, args):
        cmd = [sys.executable, "-m", "bench.inprocess", "--serve", "--prompt", essay_prompt(0)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"in-process reference exited ({self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def generate(self, tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_single(srv: BenchServer, args, sampled: bool = False, ref: Reference | None = None) -> dict:
    """One stream at a time, ``reps`` times, after one discarded warm-up request (greedy or sampled);
    with ``ref``, each followed by one in-process ``generate`` of as many tokens."""
    client = Client(srv.ws_url, timeout=args.timeout)
    extra = SAMPLED if sampled else {}
    tag = "sampled" if sampled else "single"
    runs, paired = [], []
    try:
        client.request(f"{tag}-warmup", essay_prompt(1), params(8))
        for i in range(args.reps):
            runs.append(client.request(f"{tag}-{i}", essay_prompt(0), {**params(args.tokens, seed=i + 1), **extra}))
            if ref is not None:
                paired.append(ref.generate(args.tokens))
    finally:
        client.close()
    for r in runs:
        r.pop("delta_times", None)
    out = {**summarize(runs), "runs": runs}
    if paired:
        out["reference_tok_s"] = [r["tok_s"] for r in paired]
        out["reference_tok_s_p50"] = percentile(out["reference_tok_s"], 50)
        # Each run against the reference run right after it: the machine's drift cancels pair by pair.
        out["paired_ratio_p50"] = percentile([r["tok_s"] / p["tok_s"] for r, p in zip(runs, paired)], 50)
    return out


def parallel(srv: BenchServer, args, n: int, request, meanwhile=None):
    """(results, what ``meanwhile()`` returned): ``request(client, i)`` on n connections at once, one thread each."""
    clients = [Client(srv.ws_url, timeout=args.timeout) for _ in range(n)]
    results: list = [None] * n

    def worker(i: int) -> None:
        try:
            results[i] = request(clients[i], i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        extra = meanwhile() if meanwhile is not None else None
        for t in threads:
            t.join(args.timeout)
    finally:
        for c in clients:
            c.close()
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} streams failed: {failed[0]!r}")
    return results, extra


def run_streams(srv: BenchServer, n: int, args, tag: str) -> dict:
    """``n`` clients, one connection each, sending different prompts at the same moment."""
    barrier = threading.Barrier(n)

    def request(client, i):
        barrier.wait(30)
        return client.request(f"{tag}-{n}-{i}", essay_prompt(i), params(args.tokens, seed=i + 1))

    results, _ = parallel(srv, args, n, request)
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = [r["tokens"] for r in results]
    rates = [r["tok_s"] for r in results]
    ttfd = [r["ttfd_s"] for r in results]
    return {"streams": n, "wall_s": wall, "tokens_total": sum(tokens), "tokens_min": min(tokens),
            "tokens_max": max(tokens), "aggregate_tok_s": sum(tokens) / wall,
            "stream_tok_s_p50": percentile(rates, 50), "stream_tok_s_min": min(rates),
            "ttfd_p50_s": percentile(ttfd, 50), "ttfd_p95_s": percentile(ttfd, 95), "ttfd_max_s": max(ttfd),
            "reasons": dict(collections.Counter(r["reason"] for r in results))}


def run_concurrency(srv: BenchServer, args, memory: dict) -> list[dict]:
    """The sweep, sampling the workers' resident memory at every level."""
    sweep = []
    for n in args.concurrency:
        try:
            with Sampler(srv.worker_rss, 0.1) as rss:
                row = run_streams(srv, n, args, "conc")
            row["rss_peak_mib"] = max(rss.values, default=0) / MiB
            if n == max(args.concurrency):
                memory.update(peak_streams=n, peak_rss=max(rss.values, default=0))
        except Exception as exc:
            row = {"streams": n, "error": f"{type(exc).__name__}: {exc}"}
        sweep.append(row)
        print(f"  {n:>2} streams: {json.dumps({k: v for k, v in row.items() if k != 'reasons'})}", file=sys.stderr)
    return sweep


def run_healthz(srv: BenchServer, args) -> dict:
    """/healthz latency (fresh connection per probe) while 8 streams generate."""
    def probe() -> float:
        started = time.perf_counter()
        status, _ = http_get(srv.port, "/healthz", timeout=10)
        if status != 200:
            raise RuntimeError(f"/healthz answered {status}")
        return time.perf_counter() - started

    with Sampler(probe, 0.05) as probes:
        load = run_streams(srv, 8, args, "health")
    ms = [v * 1000 for v in probes.values]
    return {"probes": len(ms), "failed": probes.errors, "p50_ms": percentile(ms, 50),
            "p95_ms": percentile(ms, 95), "max_ms": max(ms, default=None), "streams": load}


def run_cancel(srv: BenchServer, args) -> dict:
    """Cancel a running stream after a few deltas; time from sending ``cancel`` to ``done``."""
    client = Client(srv.ws_url, timeout=args.timeout)
    try:
        runs = [client.request(f"cancel-{i}", essay_prompt(i), params(512), cancel_after=args.cancel_after)
                for i in range(args.cancel_reps)]
    finally:
        client.close()
    cancelled = [r for r in runs if r["reason"] == "cancelled"]
    ms = [r["cancel_to_done_s"] * 1000 for r in cancelled]
    return {"n": len(runs), "cancelled": len(cancelled), "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95),
            "max_ms": max(ms, default=None), "deltas_after_cancel_max": max(
                (r["deltas_after_cancel"] for r in cancelled), default=None)}


def run_multiturn(srv: BenchServer, args) -> dict:
    """Six turns of one conversation with long user messages; TTFD at turn 1 against turn 6."""
    answer = min(64, args.tokens)
    per_turn = max(20, args.history_tokens // 5 - answer - 10)
    convs = []
    for c in range(args.multiturn_reps):
        client = Client(srv.ws_url, timeout=args.timeout)
        try:
            conv, turns = None, []
            for turn in range(1, 7):
                r = client.request(f"turn-{c}-{turn}", notes_message(turn + 10 * c, per_turn), params(answer),
                                   conversation_id=conv)
                conv = r["conversation_id"]
                turns.append(r)
        finally:
            client.close()
        convs.append(turns)
    logs = srv.generation_logs()
    for turns in convs:
        for r in turns:
            r["reused_tokens"] = (logs.get(r["id"]) or {}).get("reused_tokens")
    t1 = percentile([t[0]["ttfd_s"] for t in convs], 50)
    t6 = percentile([t[5]["ttfd_s"] for t in convs], 50)
    last = convs[-1]
    return {"conversations": len(convs), "ttfd_turn1_s": t1, "ttfd_turn6_s": t6, "ratio": t6 / t1,
            "turn1_prompt_tokens": last[0]["prompt_tokens"], "turn6_prompt_tokens": last[5]["prompt_tokens"],
            "turn6_reused_tokens": last[5]["reused_tokens"],
            "turns": [{k: r[k] for k in ("ttfd_s", "prompt_tokens", "reused_tokens", "tokens")} for r in last]}


def gaps(times: list) -> list:
    return [b - a for a, b in zip(times, times[1:])]


def run_join(srv: BenchServer, args) -> dict:
    """A ~2000-token prompt joins 4 running streams: their longest gap between deltas ÷ their median gap."""
    started = [threading.Event() for _ in range(4)]

    def request(client, i):
        def progress(count: int) -> None:
            if count >= 5:
                started[i].set()
        try:
            return client.request(f"join-run-{i}", essay_prompt(i), params(args.join_tokens, seed=i + 1),
                                  on_delta=progress)
        finally:
            started[i].set()

    def join():
        for event in started:
            event.wait(args.timeout)
        client = Client(srv.ws_url, timeout=args.timeout)
        try:
            return client.request("join-long", notes_message(0, args.join_prompt_tokens), params(16))
        finally:
            client.close()

    results, joiner = parallel(srv, args, 4, request, join)
    window = (joiner["sent"], joiner["first"] or joiner["done"])
    during, everything = [], []
    for r in results:
        times = r["delta_times"]
        everything += gaps(times)
        # every gap that overlaps the join's prefill (from its send to its first delta)
        during += [b - a for a, b in zip(times, times[1:]) if b >= window[0] and a <= window[1]]
    median = percentile(everything, 50)
    # while the long prompt's answer decodes beside them (its row makes the batch's span ~2000 columns)
    beside = [b - a for r in results for a, b in zip(r["delta_times"], r["delta_times"][1:])
              if joiner["first"] and a >= joiner["first"] and b <= joiner["done"]]
    beside_median = percentile(beside, 50) if beside else None
    return {"join_prompt_tokens": joiner["prompt_tokens"], "join_ttfd_s": joiner["ttfd_s"],
            "median_gap_ms": median * 1000 if median else None,
            "median_gap_beside_ms": beside_median * 1000 if beside_median else None,
            "max_gap_during_join_ms": max(during) * 1000 if during else None,
            "ratio": max(during) / median if during and median else None,
            "running_still_going": sum(1 for r in results if r["delta_times"][-1] > window[1])}


def run_v1_big(srv: BenchServer, args) -> dict:
    """A /v1 request of 200 messages x 4000 characters: time to its answer or refusal; /healthz meanwhile."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": (f"message {i} " + "x" * 4000)[:4000]}
                for i in range(199)] + [{"role": "user", "content": "y" * 4000}]
    body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()

    def probe() -> float:
        started = time.perf_counter()
        http_get(srv.port, "/healthz", timeout=60)
        return time.perf_counter() - started

    with Sampler(probe, 0.02) as probes:
        time.sleep(0.2)
        started = time.perf_counter()
        status, _ = http_post_json(srv.port, "/v1/chat/completions", body, timeout=args.timeout)
        elapsed = time.perf_counter() - started
        time.sleep(0.2)
    ms = [v * 1000 for v in probes.values]
    return {"body_bytes": len(body), "status": status, "seconds": elapsed, "healthz_probes": len(ms),
            "healthz_max_ms": max(ms, default=None), "healthz_p95_ms": percentile(ms, 95)}


def ratio(a, b):
    return a / b if a is not None and b else None


def targets(res: dict) -> list[dict]:
    """The goals of issue 10, each with its measured value."""
    def row(metric, value, goal, ok):
        return {"metric": metric, "value": value, "goal": goal, "ok": None if value is None else ok(value)}

    inproc, single, sampled = reference(res), res.get("single") or {}, res.get("sampled") or {}
    sweep = {r["streams"]: r for r in res.get("concurrency") or [] if "error" not in r}
    cancel, multi, mem = res.get("cancel") or {}, res.get("multiturn") or {}, res.get("memory") or {}
    join, big = res.get("join") or {}, res.get("v1_big") or {}
    raw8 = ((inproc.get("raw") or {}).get("8") or {}).get("tok_s")
    agg8 = (sweep.get(8) or {}).get("aggregate_tok_s")

    def paired(phase: dict):
        """Median over this phase's runs of each one ÷ the in-process generate right after it; without
        those, the phase's median ÷ the before/after in-process mean."""
        return phase.get("paired_ratio_p50") or ratio(phase.get("tok_s_p50"), inproc.get("tok_s"))

    step_ms = 1000 / single["tok_s_p50"] if single.get("tok_s_p50") else None
    delta = mem["peak_rss"] - mem["idle_rss"] if mem.get("peak_rss") and mem.get("idle_rss") else None
    return [
        row("one stream sampled (T 0.7, top-p 0.9) over WS ÷ greedy in-process generate",
            paired(sampled), "≥ 0.95", lambda v: v >= 0.95),
        row("one stream greedy over WS ÷ greedy in-process generate",
            paired(single), "≥ 0.95", lambda v: v >= 0.95),
        row("aggregate tok/s at 8 streams ÷ one stream", ratio(agg8, single.get("aggregate_tok_s_p50")),
            "≥ 5", lambda v: v >= 5),
        row("aggregate tok/s at 8 streams ÷ raw batch-8 forward loop", ratio(agg8, raw8), "≥ 0.85",
            lambda v: v >= 0.85),
        row("p95 TTFD at 8 ÷ single", ratio((sweep.get(8) or {}).get("ttfd_p95_s"), single.get("ttfd_p95_s")),
            "≤ 3", lambda v: v <= 3),
        row("2000-token prompt joining 4 streams: their max gap ÷ median gap", join.get("ratio"), "≤ 4",
            lambda v: v <= 4),
        row("TTFD turn 6 ÷ turn 1 (~2000-token conversation)", multi.get("ratio"), "≤ 1.5", lambda v: v <= 1.5),
        row("200 x 4000-char /v1 request answered or refused (s)", big.get("seconds"), "≤ 2", lambda v: v <= 2),
        row("/healthz max during that request (ms)", big.get("healthz_max_ms"), "≤ 100", lambda v: v <= 100),
        row("cancel → done p95 (ms)", cancel.get("p95_ms"),
            f"≤ one step + 50 = {step_ms + 50:.0f}" if step_ms else "≤ one step + 50",
            lambda v: step_ms is not None and v <= step_ms + 50),
        row("RSS growth idle → 16 streams (MiB)", delta / MiB if delta is not None else None, "≤ 1024",
            lambda v: v <= 1024),
    ] + webtier.targets(res.get("webtier") or {}, row)


def figures(res: dict) -> list[tuple[str, object]]:
    """The raw numbers behind the targets, in reading order."""
    inproc, single, sampled = reference(res), res.get("single") or {}, res.get("sampled") or {}
    cancel, health = res.get("cancel") or {}, res.get("healthz") or {}
    multi, mem, start = res.get("multiturn") or {}, res.get("memory") or {}, res.get("startup") or {}
    join, big, raw = res.get("join") or {}, res.get("v1_big") or {}, inproc.get("raw") or {}

    def ms(v):
        return v * 1000 if v is not None else None

    def mib(v):
        return v / MiB if v else None

    return [
        ("in-process generate tok/s (batch 1): mean, before the server / after the single streams",
         _pair(inproc.get("tok_s"), *[(res.get(k) or {}).get("tok_s") for k in ("inprocess", "inprocess_after")])),
        ("in-process prefill ms", ms(inproc.get("prefill_s"))),
        ("raw forward loop tok/s at batch 1 / 8 / 16", _pair(*[(raw.get(b) or {}).get("tok_s") for b in RAW])),
        ("raw forward loop ms per step at batch 1 / 8 / 16", _pair(*[(raw.get(b) or {}).get("step_ms") for b in RAW])),
        ("prompt tokens (single stream)", inproc.get("prompt_tokens")),
        ("server single stream tok/s greedy / sampled (delivered, p50)",
         _pair(single.get("tok_s_p50"), sampled.get("tok_s_p50"))),
        ("in-process generate tok/s interleaved with the greedy / sampled runs (p50)",
         _pair(single.get("reference_tok_s_p50"), sampled.get("reference_tok_s_p50"))),
        ("greedy / sampled: ratio of those medians (the targets use the median of the pairs' ratios)",
         _pair(*[_three(ratio(p.get("tok_s_p50"), p.get("reference_tok_s_p50"))) for p in (single, sampled)])),
        ("server single TTFD p50 / p95 ms", _pair(ms(single.get("ttfd_p50_s")), ms(single.get("ttfd_p95_s")))),
        ("server-reported TTFT p50 ms", single.get("server_ttft_ms_p50")),
        ("decode step ms (1 ÷ single tok/s)", 1000 / single["tok_s_p50"] if single.get("tok_s_p50") else None),
        ("cancel → done p50 / p95 / max ms", _pair(cancel.get("p50_ms"), cancel.get("p95_ms"), cancel.get("max_ms"))),
        ("deltas received after cancel (max)", cancel.get("deltas_after_cancel_max")),
        ("/healthz under 8 streams p50 / p95 / max ms",
         _pair(health.get("p50_ms"), health.get("p95_ms"), health.get("max_ms"))),
        ("join: prompt tokens / its TTFD ms", _pair(join.get("join_prompt_tokens"), ms(join.get("join_ttfd_s")))),
        ("join: running streams' median gap / max gap during the join ms",
         _pair(join.get("median_gap_ms"), join.get("max_gap_during_join_ms"))),
        ("join: running streams' median gap while the long prompt's answer decodes beside them ms",
         join.get("median_gap_beside_ms")),
        ("TTFD turn 1 / turn 6 ms", _pair(ms(multi.get("ttfd_turn1_s")), ms(multi.get("ttfd_turn6_s")))),
        ("turn 6 prompt tokens / reused from cache",
         _pair(multi.get("turn6_prompt_tokens"), multi.get("turn6_reused_tokens"))),
        ("200 x 4000-char /v1: status / seconds / body bytes",
         _pair(big.get("status"), big.get("seconds"), big.get("body_bytes"))),
        ("/healthz during it p95 / max ms", _pair(big.get("healthz_p95_ms"), big.get("healthz_max_ms"))),
        ("start-up to /readyz s (weights cache warm?)",
         f"{start['ready_s']:.1f} ({_fmt_warm(start.get('cache_warm'))})" if start.get("ready_s") else None),
        ("worker RSS MiB: idle at start / after one stream / peak at 16 / at the end",
         _pair(mib(mem.get("idle_rss")), mib(mem.get("warm_idle_rss")), mib(mem.get("peak_rss")),
               mib(mem.get("end_rss")))),
        ("load average before the run (1 min)", res["machine"].get("loadavg_before")),
    ] + [(f"reference: {name}", value) for name, value in LLAMA_CPP]


def _pair(*values) -> str | None:
    if all(v is None for v in values):
        return None
    return " / ".join("—" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v)) for v in values)


def _three(value) -> str | None:
    return None if value is None else f"{value:.3f}"


def _fmt_warm(warm) -> str:
    return {True: "warm", False: "cold: converted the GGUF", None: "n/a"}[warm]


def phase(res: dict, name: str, fn, *args) -> None:
    """Run one phase; a failure is recorded and the run goes on."""
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        res[name] = fn(*args)
    except Exception as exc:
        traceback.print_exc()
        res[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[bench] {name} took {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (numbers not representative)")
    parser.add_argument("--tokens", type=int, help="new tokens per request (default 128; --quick 16)")
    parser.add_argument("--reps", type=int, help="single-stream repetitions (default 5; --quick 2)")
    parser.add_argument("--inprocess-reps", type=int, help="in-process repetitions (default 3; --quick 1)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16],
                        help="comma-separated stream counts (default 1,2,4,8,16)")
    parser.add_argument("--cancel-reps", type=int, help="cancel repetitions (default 10; --quick 3)")
    parser.add_argument("--cancel-after", type=int, default=5, help="deltas to wait before cancelling")
    parser.add_argument("--history-tokens", type=int, help="history before turn 6 (default 2000; --quick 300)")
    parser.add_argument("--join-prompt-tokens", type=int,
                        help="prompt joining running streams (default 2000; --quick 300)")
    parser.add_argument("--join-tokens", type=int,
                        help="answer length of the running streams (default 256; --quick 64)")
    parser.add_argument("--multiturn-reps", type=int, help="conversations of 6 turns (default 3; --quick 1)")
    parser.add_argument("--max-batch", type=int, help="the server's CHAT_MAX_BATCH (default: 16, or the largest "
                        "--concurrency); run twice (8 and 16) to compare batch sizes")
    parser.add_argument("--skip-inprocess", action="store_true", help="skip the in-process limit")
    parser.add_argument("--skip-healthz", action="store_true")
    parser.add_argument("--skip-cancel", action="store_true")
    parser.add_argument("--skip-multiturn", action="store_true")
    parser.add_argument("--skip-sampled", action="store_true")
    parser.add_argument("--skip-join", action="store_true")
    parser.add_argument("--skip-v1-big", action="store_true")
    parser.add_argument("--skip-webtier", action="store_true", help="skip the web tier's capacity (stub upstream)")
    parser.add_argument("--only-webtier", action="store_true",
                        help="only the web tier's capacity: no model needed; writes webtier.* unless --name")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--webtier-workers", type=ints, default=[1, 4], help="gunicorn workers (default 1,4)")
    parser.add_argument("--webtier-clients", type=ints, default=[8, 32, 128, 256],
                        help="concurrent WebSocket clients (default 8,32,128,256)")
    parser.add_argument("--webtier-rate", type=float, default=50, help="stub tokens/s per stream (default 50)")
    parser.add_argument("--webtier-tokens", type=int, default=300, help="tokens per chat (default 300)")
    parser.add_argument("--webtier-chats", type=int, default=2, help="chats per client in a row (default 2)")
    parser.add_argument("--webtier-first-delay", type=float, default=0.02,
                        help="stub seconds before the first token (default 0.02)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a phase's wait gives up")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    parser.add_argument("--name", help="output file stem (default latest; webtier with --only-webtier)")
    return parser


def resolve_sizes(args) -> None:
    """Fill unset sizes from the full or the --quick defaults."""
    defaults = {"tokens": (128, 16), "reps": (5, 2), "inprocess_reps": (3, 1), "cancel_reps": (10, 3),
                "history_tokens": (2000, 300), "multiturn_reps": (3, 1),
                "join_prompt_tokens": (2000, 300), "join_tokens": (256, 64)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def server_env(workdir: Path, args) -> dict:
    """The server's settings: a scratch data folder, the shared weights cache, room for 16 streams."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("CHAT_CACHE_DIR", str(ROOT / "data" / "model-cache"))
    batch = args.max_batch or max(16, *args.concurrency)
    env.update({"CHAT_DATA_DIR": str(workdir / "data"), "CHAT_MAX_BATCH": str(batch),
                "CHAT_CONTEXT_TOKENS": "4096", "CHAT_MAX_NEW_TOKENS": str(max(512, args.tokens)),
                "CHAT_RATE_LIMIT_PER_MIN": "0", "CHAT_MAX_CONNECTIONS_PER_IP": "0", "CHAT_WORKERS": "1",
                # every bench stream comes from 127.0.0.1
                "CHAT_RATE_LIMIT_PER_IP_PER_MIN": "0", "CHAT_MAX_ACTIVE_PER_IP": "0",
                "CHAT_GRACEFUL_TIMEOUT_S": "5"})
    return env


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    resolve_sizes(args)
    if args.name is None:
        args.name = "webtier" if args.only_webtier else "latest"
    load_before = os.getloadavg()[0]
    res: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="chat-bench-") as tmp:
        workdir = Path(tmp)
        if args.only_webtier:
            res["machine"] = {**basic_machine(), "loadavg_before": load_before}
            phase(res, "webtier", webtier.run_webtier, workdir, args)
            return write(res, args)
        env = server_env(workdir, args)
        if not args.skip_inprocess:
            phase(res, "inprocess", run_inprocess, env, args)
        res["machine"] = {**machine_facts(env), "loadavg_before": load_before}
        srv = BenchServer(workdir, env)
        try:
            print("[bench] starting the server ...", file=sys.stderr, flush=True)
            res["startup"] = {"ready_s": srv.start(timeout=args.timeout), "cache_warm": res["machine"].get("cache_warm")}
            time.sleep(1.0)
            res["memory"] = {"idle_rss": srv.worker_rss()}
            hello = Client(srv.ws_url)
            res["machine"]["model"] = hello.ready.get("model")
            hello.close()
            ref = None
            if not args.skip_inprocess:
                print("[bench] loading the paired in-process reference ...", file=sys.stderr, flush=True)
                ref = Reference(env, args)
            try:
                phase(res, "single", run_single, srv, args, False, ref)
                if not args.skip_sampled:
                    phase(res, "sampled", run_single, srv, args, True, ref)
            finally:
                if ref is not None:
                    ref.close()
            if not args.skip_inprocess:  # the reference again, next to what it is compared with
                phase(res, "inprocess_after", run_inprocess, env, args)
            res["memory"]["warm_idle_rss"] = srv.worker_rss()
            print("[bench] concurrency ...", file=sys.stderr, flush=True)
            res["concurrency"] = run_concurrency(srv, args, res["memory"])
            if not args.skip_healthz:
                phase(res, "healthz", run_healthz, srv, args)
            if not args.skip_cancel:
                phase(res, "cancel", run_cancel, srv, args)
            if not args.skip_join:
                phase(res, "join", run_join, srv, args)
            if not args.skip_multiturn:
                phase(res, "multiturn", run_multiturn, srv, args)
            if not args.skip_v1_big:
                phase(res, "v1_big", run_v1_big, srv, args)
            res["memory"]["end_rss"] = srv.worker_rss()
        except Exception:
            print(srv.log_tail(), file=sys.stderr)
            raise
        finally:
            srv.stop()
        if not args.skip_webtier:
            phase(res, "webtier", webtier.run_webtier, workdir, args)
    res["machine"].setdefault("model", (res.get("inprocess") or {}).get("model"))
    return write(res, args)


def write(res: dict, args) -> int:
    """Targets and figures computed, the report written and printed; 1 when a phase failed."""
    res["targets"] = targets(res)
    res["figures"] = figures(res)
    if args.only_webtier:  # the model's rows would all be empty
        res["targets"] = [t for t in res["targets"] if t["value"] is not None]
        res["figures"] = [f for f in res["figures"] if f[1] is not None and not f[0].startswith("reference")]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    md = report.markdown(res)
    caption = "web tier: deltas/s and delta latency against clients" if args.only_webtier else \
        "tokens/s and TTFD against concurrency"
    stem.with_suffix(".md").write_text(md + f"\n![{caption}]({args.name}.png)\n")
    report.chart(res, stem.with_suffix(".png"))
    print(md)
    print(f"wrote {stem}.json, .md, .png", file=sys.stderr)
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    failed += [f"concurrency {r['streams']}" for r in res.get("concurrency") or [] if "error" in r]
    failed += [f"webtier {r['clients']}" for r in (res.get("webtier") or {}).get("sweep", []) if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
