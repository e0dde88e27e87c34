"""The benchmark's phases against this server: the in-process limit, one stream (paired with an
in-process reference), a long prompt's prefill (paired too), the concurrency sweep, /healthz under
load, cancel, a long prompt joining, the long conversation, a huge /v1 request, and the quantized
path's quality. Each returns a dict for the report (see bench/README.md).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import workloads
from .server import ROOT, BenchServer, Client, Sampler, http_get, http_post_json, metric
from .stats import percentile
from .workloads import essay_prompt, notes_message, params

MiB = 1024 * 1024
RAW = ("1", "8", "16")  # batch sizes of the raw forward loop


def connect(srv: BenchServer, args):
    """A factory of timing chat.v1 clients on ``srv``, for the workloads: ``connect(user)`` connects from its own
    loopback address (127.0.0.2, 3, ...), so users sent together are different clients to the server, as
    people behind their own addresses are (the scheduler shares prefill between addresses, not requests);
    ``connect()`` from the default one."""
    def make(user: int | None = None) -> Client:
        source = f"127.0.0.{2 + user}" if user is not None and "//127.0.0.1:" in srv.ws_url else None
        return Client(srv.ws_url, timeout=args.timeout, source=source)
    return make


def basic_machine() -> dict:
    """CPU, cores and Python, without asking torch (the web-tier phase needs no model)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def machine_facts(env: dict) -> dict:
    """CPU, cores, torch/transformers versions and threads, dtype, native bf16, CHAT_QUANT, the GGUF."""
    code = ("import json, torch, transformers\n"
            "from chat.engine.kernels import cpu\nfrom chat.engine.model import loader as m\n"
            "from chat.config import Settings\n"
            "s = Settings.from_env()\n"
            "if s.threads:\n"
            "    torch.set_num_threads(s.threads)\n"
            "device = m.pick_device(s.device)\n"
            "found = m.gguf_source(s.model)\n"
            "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,\n"
            "    'torch_threads': torch.get_num_threads(), 'device': str(device),\n"
            "    'dtype': str(m.pick_dtype(s.dtype, device)).removeprefix('torch.'),\n"
            "    'native_bf16': m.cpu_has_native_bf16(s.cpu_isa), 'cpu_class': cpu.detect(s.cpu_isa).describe(),\n"
            "    'quant': s.quant,\n"
            "    'gguf': str(found[0]) if found else None, 'system_prompt': s.system_prompt}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    facts = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}
    return {**basic_machine(), **facts}


def run_inprocess(env: dict, args) -> dict:
    """Plain ``generate`` and the raw forward loop in a fresh subprocess (model on a worker thread)."""
    cmd = [sys.executable, "-m", "bench.inprocess", "--prompt", essay_prompt(0), "--tokens", str(args.tokens),
           "--reps", str(args.inprocess_reps), "--batches", ",".join(RAW)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"in-process run failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


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
        return self._ask({"tokens": tokens})

    def prefill(self, text: str) -> dict:
        return self._ask({"prefill": text})

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_single(srv: BenchServer, args, sampled: bool = False, ref: Reference | None = None) -> dict:
    """One stream at a time, greedy or sampled; with ``ref``, each request followed by one in-process
    ``generate`` of as many tokens, and the ratio taken pair by pair (the machine's drift cancels)."""
    after = (lambda: ref.generate(args.tokens)) if ref is not None else None
    out = workloads.single(connect(srv, args), args, "sampled" if sampled else "single",
                           workloads.SAMPLED if sampled else None, after)
    paired = out.pop("paired")
    if paired:
        out["reference_tok_s"] = [r["tok_s"] for r in paired]
        out["reference_tok_s_p50"] = percentile(out["reference_tok_s"], 50)
        out["paired_ratio_p50"] = percentile([r["tok_s"] / p["tok_s"] for r, p in zip(out["runs"], paired)], 50)
    return out


def wait_finished(srv: BenchServer, timeout: float = 120) -> float | None:
    """Seconds until /readyz stops saying ``finishing`` (the idle chores after start-up: crossovers,
    building the C++ step), so no phase shares the engine with them; None when it never says it."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        status, body = http_get(srv.port, "/readyz")
        if status == 200 and not json.loads(body).get("finishing"):
            return time.perf_counter() - started
        time.sleep(0.2)
    return None


def run_prefill(srv: BenchServer, args, ref: Reference) -> dict:
    """A long message's prefill inside the server (its own ``ttft_ms``: request to first token, one
    new token) against the same prompt's prefill in a plain process, pair by pair."""
    pairs = []
    for i in range(args.prefill_reps):
        text = notes_message(100 + i, args.prefill_tokens)  # a new turn number each time: nothing to reuse
        client = Client(srv.ws_url, timeout=args.timeout)
        try:
            run = client.request(f"prefill{i}", text, {"temperature": 0, "max_new_tokens": 1})
        finally:
            client.close()
        plain = ref.prefill(text)
        pairs.append({"server_ms": run["server_ttft_ms"], "plain_ms": plain["prefill_s"] * 1000,
                      "prompt_tokens": run["prompt_tokens"], "plain_prompt_tokens": plain["prompt_tokens"]})
    ratios = [p["server_ms"] / p["plain_ms"] for p in pairs]
    return {"pairs": pairs, "ratio_p50": percentile(ratios, 50),
            "server_ms_p50": percentile([p["server_ms"] for p in pairs], 50),
            "plain_ms_p50": percentile([p["plain_ms"] for p in pairs], 50)}


def run_quality(env: dict, args) -> dict:
    """``bench.quality`` in a subprocess: the quantized path's greedy answers and perplexity against dense."""
    out = subprocess.run([sys.executable, "-m", "bench.quality"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=args.timeout)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"quality run failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_structured(env: dict, args) -> dict:
    """``bench.structured`` in a subprocess: schema answers with and without json_schema, the masks'
    cost at 8 rows, compile times, prompt scoring."""
    out = subprocess.run([sys.executable, "-m", "bench.structured", str(max(1, min(args.reps, 3)))], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=max(args.timeout, 1800))
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"structured run failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def run_concurrency(srv: BenchServer, args, memory: dict) -> list[dict]:
    """The sweep, sampling the workers' resident memory at every level."""
    sweep = []
    for n in args.concurrency:
        try:
            with Sampler(srv.worker_rss, 0.1) as rss:
                row = workloads.streams(connect(srv, args), n, args, "conc")
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
        load = workloads.streams(connect(srv, args), 8, args, "health")
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
    """Six turns of one conversation; the prompt tokens reused from the prefix cache come from /metrics."""
    return workloads.multiturn(connect(srv, args), args,
                               reused=lambda: metric(srv.port, "chat_prompt_tokens_reused_total"))


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

    results, joiner = workloads.parallel(connect(srv, args), 4, request, join, args.timeout)
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
