"""The report's judgements: the goals (the engine's, the web tier's, and against llama.cpp's server when it ran
beside this one) each with its measured value, and the raw figures behind them."""
from __future__ import annotations

import statistics

from . import peer, webtier
from .phases import RAW, MiB


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


def ratio(a, b):
    return a / b if a is not None and b else None


def targets(res: dict) -> list[dict]:
    """Every goal, each with its measured value."""
    def row(metric, value, goal, ok):
        return {"metric": metric, "value": value, "goal": goal, "ok": None if value is None else ok(value)}

    inproc, single, sampled = reference(res), res.get("single") or {}, res.get("sampled") or {}
    sweep = {r["streams"]: r for r in res.get("concurrency") or [] if "error" not in r}
    cancel, mem = res.get("cancel") or {}, res.get("memory") or {}
    join, big = res.get("join") or {}, res.get("v1_big") or {}
    prefill, start = res.get("prefill") or {}, res.get("startup") or {}
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
        row("8 streams while all 8 decode (last first delta to first end), deltas/s ÷ raw batch-8 forward loop",
            ratio((sweep.get(8) or {}).get("steady_deltas_s"), raw8), "≥ 0.9", lambda v: v >= 0.9),
        row("p95 TTFD at 8 ÷ single", ratio((sweep.get(8) or {}).get("ttfd_p95_s"), single.get("ttfd_p95_s")),
            "≤ 3", lambda v: v <= 3),
        row("2000-token prompt joining 4 streams: their max gap ÷ median gap", join.get("ratio"), "≤ 4",
            lambda v: v <= 4),
        row("200 x 4000-char /v1 request answered or refused (s)", big.get("seconds"), "≤ 2", lambda v: v <= 2),
        row("/healthz max during that request (ms)", big.get("healthz_max_ms"), "≤ 100", lambda v: v <= 100),
        row("cancel → done p95 (ms)", cancel.get("p95_ms"),
            f"≤ one step + 50 = {step_ms + 50:.0f}" if step_ms else "≤ one step + 50",
            lambda v: step_ms is not None and v <= step_ms + 50),
        row(f"RSS growth idle → {mem.get('peak_streams', 16)} streams (MiB)",
            delta / MiB if delta is not None else None, "≤ 1024", lambda v: v <= 1024),
        row("a 1000-token message's prefill: in the server ÷ a plain process (median of pairs)",
            prefill.get("ratio_p50"), "≤ 1.15", lambda v: v <= 1.15),
        row("start-up to /readyz, empty data folder (s)", start.get("ready_s"), "≤ 10", lambda v: v <= 10),
    ] + quality_targets(res.get("quality") or {}, row) + structured_targets(res.get("structured") or {}, row) \
        + peer.targets(res, row) + draft_targets(res.get("drafts") or {}, row) \
        + restart_targets(res.get("restart") or {}, row) + webtier.targets(
        res.get("webtier") or {}, row)


def draft_targets(d: dict, row) -> list[dict]:
    """Issue 34's goals for drafted tokens: the edit workload faster, the story no slower."""
    if not d.get("ngram"):
        return []
    return [row("edit workload, one stream: drafts ÷ no drafts", d.get("edit_ratio_off"), "≥ 1.8", lambda v: v >= 1.8),
            row("edit workload, one stream: drafts ÷ llama.cpp's server (no drafts)", d.get("edit_ratio_peer"),
                "≥ 1.5", lambda v: v >= 1.5),
            row("story workload, one stream: drafts ÷ no drafts", d.get("story_ratio_off"), "≥ 0.97",
                lambda v: v >= 0.97)]


def restart_targets(r: dict, row) -> list[dict]:
    """Issue 34's stretch goal: turn 2 after a restart, from the KV on disk."""
    if not r.get("ratio"):
        return []
    return [row("turn 2 after a restart ÷ a warm turn 2, first delta", r["ratio"], "≤ 1.5", lambda v: v <= 1.5)]


def structured_targets(s: dict, row) -> list[dict]:
    """Issue 31's goals: schema answers, the masks' cost, compile time, prompt scoring; issue 42's: the budget
    close's cost at 1 and 8 rows."""
    if not s.get("validity"):
        return []
    valid, mask, scoring = s["validity"], s.get("mask") or {}, s.get("scoring") or {}
    budget = s.get("budget") or {}
    # the summed log probability's difference, per token (single tokens differ more: bench/structured.py)
    return [row(f"50 schema prompts valid with json_schema, % (without: {valid['free']['percent']:.0f}%)",
                valid["json_schema"]["percent"], "= 100", lambda v: v >= 100),
            row("8 constrained rows' aggregate tok/s ÷ 8 free rows'", mask.get("ratio_p50"), "≥ 0.9",
                lambda v: v >= 0.9),
            *[row(f"{n} row(s) closed by their budget: tok/s ÷ free rows'", (budget.get(f"rows_{n}") or {}).get(
                "ratio_p50"), "≥ 0.9", lambda v: v >= 0.9) for n in (1, 8)],
            row("first compile of the 5 schemas, slowest (ms)", (s.get("compile") or {}).get("max_first_ms"),
                "≤ 50", lambda v: v <= 50),
            row("echo + logprobs: summed log probability against quality.py's token-by-token run, difference per token",
                scoring.get("sum_diff_per_token"), "≤ 1e-3", lambda v: v <= 1e-3)]


def quality_targets(q: dict, row) -> list[dict]:
    """The quality goals: the quantized path against CHAT_QUANT=off on the same questions and text."""
    if not q.get("auto") or not q.get("off"):
        return []
    auto, off = q["auto"], q["off"]
    return [row(f"questions right, {auto['weights']} ÷ {off['weights']} weights ({auto['right']} / {off['right']})",
                auto["right"] / off["right"] if off["right"] else None, "≥ 1", lambda v: v >= 1),
            row("perplexity of a fixed text, quantized ÷ dense", q["summary"]["perplexity_ratio"], "≤ 1.01",
                lambda v: v <= 1.01)]


def figures(res: dict) -> list[tuple[str, object]]:
    """The raw numbers behind the targets, in reading order."""
    inproc, single, sampled = reference(res), res.get("single") or {}, res.get("sampled") or {}
    cancel, health = res.get("cancel") or {}, res.get("healthz") or {}
    multi, mem, start = res.get("multiturn") or {}, res.get("memory") or {}, res.get("startup") or {}
    join, big, raw = res.get("join") or {}, res.get("v1_big") or {}, inproc.get("raw") or {}
    prefill = res.get("prefill") or {}

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
        ("start-up to /readyz s / then to the end of the idle chores (crossovers, C++ step) s",
         _pair(start.get("ready_s"), start.get("finished_s"))),
        ("weights of the decode path (/readyz)", (start.get("readyz") or {}).get("weights")),
        ("decode step (/readyz, after the idle chores)", (start.get("readyz") or {}).get("decode")),
        ("prefill of a long message: prompt tokens / in the server / in a plain process ms (p50)",
         _pair(((prefill.get("pairs") or [{}])[0]).get("prompt_tokens"), prefill.get("server_ms_p50"),
               prefill.get("plain_ms_p50"))),
        ("quality: questions right quantized / dense / dense float32, identical answers (quantized and dense; "
         "dense and float32), mean shared prefix",
         _pair(*(_quality(res.get("quality") or {})))),
        ("quality: perplexity quantized / dense", _pair(*((res.get("quality") or {}).get("summary") or {}).get(
            "perplexity", [None, None]))),
        (f"worker RSS MiB: idle at start / after one stream / peak at {mem.get('peak_streams', 16)} / at the end",
         _pair(mib(mem.get("idle_rss")), mib(mem.get("warm_idle_rss")), mib(mem.get("peak_rss")),
               mib(mem.get("end_rss")))),
        ("drafts: edit workload tok/s with / without drafts / llama.cpp's server", _pair(*_drafts(res, "edit"))),
        ("drafts: story workload tok/s with / without drafts / llama.cpp's server", _pair(*_drafts(res, "story"))),
        ("drafts: tokens per step with drafts / drafted tokens accepted %", _pair(*_accepted(res))),
        ("turn 2 first delta ms: warm / after a restart (KV from disk) / its prompt tokens",
         _pair(*[(res.get("restart") or {}).get(k) for k in ("warm_turn2_ms", "restart_turn2_ms",
                                                             "turn2_prompt_tokens")])),
        ("load average before the run (1 min)", res["machine"].get("loadavg_before")),
    ]


def _drafts(res: dict, name: str) -> tuple:
    d = res.get("drafts") or {}
    return tuple(((d.get(side) or {}).get(name) or {}).get("tok_s_p50") for side in ("ngram", "off", "peer"))


def _accepted(res: dict) -> tuple:
    on = (res.get("drafts") or {}).get("ngram") or {}
    drafted = on.get("drafted_tokens")
    return on.get("tokens_per_draft_step"), 100 * on["draft_accepted_tokens"] / drafted if drafted else None


def _pair(*values) -> str | None:
    if all(v is None for v in values):
        return None
    return " / ".join("—" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v)) for v in values)


def _three(value) -> str | None:
    return None if value is None else f"{value:.3f}"


def _quality(q: dict) -> tuple:
    if not q.get("summary"):
        return (None,)
    f = q.get("float32") or {}
    return (q["auto"]["right"], q["off"]["right"], f.get("right"), q["summary"]["identical"],
            q["summary"].get("dense_identical"), round(q["summary"]["mean_shared_prefix"], 2))
