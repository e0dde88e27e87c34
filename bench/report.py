"""Turn a benchmark result into a markdown report and a PNG chart."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

from . import peer, webtier


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _ok(value) -> str:
    return {True: "✅", False: "❌"}.get(value, "")


def sampling(args: dict) -> str:
    """How the requests were sampled (bench.run's --temperature and filters)."""
    if args.get("temperature") is None:
        return "greedy requests (but the sampled single stream)"
    parts = [f"temperature {args['temperature']}"] + [f"{name} {args[key]}" for name, key in
                                                      (("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"))
                                                      if args.get(key) is not None]
    return "every request sampled: " + ", ".join(parts) + (", no seed" if args.get("unseeded") else ", seeded")


def markdown(result: dict) -> str:
    """The report: targets, raw figures, the concurrency sweep, the machine."""
    m = result["machine"]
    lines = [f"# Chat server benchmark — {result['date']}", ""]
    if result["args"].get("only_webtier"):
        lines += [f"Web tier only (no model) on {m.get('cpu')}, {m.get('cores')} cores, Python {m.get('python')}.", ""]
    else:
        lines += [f"{m.get('model')} ({m.get('dtype')}, {m.get('device')}) on {m.get('cpu')}, "
                  f"{m.get('cores')} cores, torch {m.get('torch')} with {m.get('torch_threads')} threads; "
                  f"{result['args']['tokens']} new tokens per request"
                  + (" (**--quick**: smoke-test sizes, not representative)" if result["args"]["quick"] else "")
                  + "; " + sampling(result["args"]) + ".", ""]
    if m.get("loadavg_before", 0) > 0.25 * (m.get("cores") or 1):
        lines += [f"**Warning:** load average {m['loadavg_before']:.1f} on {m.get('cores')} cores before the run: "
                  "other work shared the CPU, so these numbers understate the server.", ""]
    lines += ["| target | value | goal | met |", "|---|---|---|---|"]
    for row in result["targets"]:
        lines.append(f"| {row['metric']} | {_fmt(row['value'])} | {row['goal']} | {_ok(row['ok'])} |")
    lines += ["", "| figure | value |", "|---|---|"]
    for name, value in result["figures"]:
        lines.append(f"| {name} | {_fmt(value)} |")
    lines += peer.markdown(result)
    sweep = result.get("concurrency") or []
    if sweep:
        lines += ["", "| streams | tokens (min–max each) | aggregate tok/s | per-stream tok/s p50 | "
                      "TTFD p50 ms | TTFD p95 ms | peak RSS MiB | done reasons |", "|---|---|---|---|---|---|---|---|"]
        for row in sweep:
            if "error" in row:
                lines.append(f"| {row['streams']} | error: {row['error']} | | | | | | |")
                continue
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["reasons"].items()))
            lines.append(f"| {row['streams']} | {row['tokens_total']} ({row['tokens_min']}–{row['tokens_max']}) | "
                         f"{row['aggregate_tok_s']:.1f} | {row['stream_tok_s_p50']:.1f} | "
                         f"{row['ttfd_p50_s'] * 1000:.0f} | {row['ttfd_p95_s'] * 1000:.0f} | "
                         f"{row['rss_peak_mib']:.0f} | {reasons} |")
    if "sweep" in (result.get("webtier") or {}):
        lines += webtier.markdown(result["webtier"])
    errors = {k: v["error"] for k, v in result.items() if isinstance(v, dict) and "error" in v}
    if errors:
        lines += ["", "Phases that failed:", ""] + [f"* {k}: {v}" for k, v in errors.items()]
    return "\n".join(lines) + "\n"


def chart(result: dict, path) -> None:
    """Tokens/s and time to first delta against the number of concurrent streams."""
    sweep = [r for r in result.get("concurrency") or [] if "error" not in r]
    if not sweep and "sweep" in (result.get("webtier") or {}):
        return webtier_chart(result, path)
    if not sweep:
        return None  # no concurrency sweep in this run (--only without it): nothing to draw
    fig, (rate, ttfd) = plt.subplots(1, 2, figsize=(11, 4.2))
    n = [r["streams"] for r in sweep]
    rate.plot(n, [r["aggregate_tok_s"] for r in sweep], "o-", label="aggregate (server)")
    rate.plot(n, [r["stream_tok_s_p50"] for r in sweep], "s-", label="per stream, median (server)")
    inproc = result.get("inprocess") or {}
    if inproc.get("tok_s"):
        rate.axhline(inproc["tok_s"], color="grey", ls="--", label="in-process generate, batch 1")
    rate.set(title="Tokens per second", xlabel="concurrent streams", ylabel="tokens/s")
    ttfd.plot(n, [r["ttfd_p50_s"] * 1000 for r in sweep], "o-", label="p50")
    ttfd.plot(n, [r["ttfd_p95_s"] * 1000 for r in sweep], "s-", label="p95")
    if inproc.get("prefill_s"):
        ttfd.axhline(inproc["prefill_s"] * 1000, color="grey", ls="--", label="in-process prefill")
    ttfd.set(title="Time to first delta", xlabel="concurrent streams", ylabel="ms")
    for ax in (rate, ttfd):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n or [1])
        ax.set_xticklabels([str(x) for x in n] or ["1"])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"{m.get('model')} ({m.get('dtype')}), {m.get('cores')} cores, "
                 f"{result['args']['tokens']} new tokens, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def webtier_chart(result: dict, path) -> None:
    """Delivered deltas/s and p99 delta latency against clients, one line per worker count."""
    rows = [r for r in result["webtier"]["sweep"] if "error" not in r]
    fig, (rate, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for workers in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == workers]
        n = [r["clients"] for r in mine]
        rate.plot(n, [r["deltas_per_s"] for r in mine], "o-", label=f"{workers} worker(s) delivered")
        lat.plot(n, [r["latency_p99_ms"] for r in mine], "o-", label=f"{workers} worker(s) p99")
    n = sorted({r["clients"] for r in rows})
    rate.plot(n, [c * result["webtier"]["rate"] for c in n], "k--", label="offered")
    rate.set(title="Deltas per second", xlabel="WebSocket clients", ylabel="deltas/s")
    lat.set(title="Delta latency (upstream send → client)", xlabel="WebSocket clients", ylabel="ms", yscale="log")
    for ax in (rate, lat):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"web tier, stub upstream, {result['machine'].get('cores')} cores, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
