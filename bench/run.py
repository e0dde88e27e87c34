"""``python -m bench.run``: measure the chat server against the real bundled model, in one run.

Phases: the in-process limit (a plain greedy generation and a raw forward loop at batch 1/8/16 on
the engine's own decoder, in a subprocess), start-up, one stream (greedy, then sampled), a long
message's prefill in the server against a plain process, concurrency 1/2/4/8/16, /healthz under
load, cancel latency, a long prompt joining running streams, a long multi-turn conversation, a huge
/v1 request, resident memory, the quantized path's quality against dense weights, the web tier's
capacity, and llama.cpp's server on the same workloads when ``LLAMA_SERVER`` names one. Writes ``latest.json``,
``latest.md`` and ``latest.png`` to ``bench/results/`` (or ``--out``) and prints the markdown.

The modules: ``workloads`` (prompts, and the work any server gets), ``phases`` (this server's
phases), ``peer`` (llama.cpp's server), ``webtier`` (the relay's capacity), ``targets`` (goals and
figures), ``report`` (markdown and chart), ``server`` (the live server, shared with the tests).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import drafts, peer, phases, report, restart, targets, webtier, workloads
from .server import ROOT, BenchServer, Client, http_get

# Every phase, in the order a full run takes them; --only picks some.
PHASES = ("inprocess", "single", "sampled", "prefill", "concurrency", "healthz", "cancel", "join", "multiturn",
          "v1-big", "quality", "structured", "webtier", "peer", "drafts", "restart")
# --only peer: this server and llama.cpp's on the comparison's workloads, nothing else (a few minutes).
PRESETS = {"peer": ("single", "concurrency", "multiturn", "peer")}


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
    parser.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                        help=f"run only these phases: {', '.join(PHASES)}; or 'peer' for this server beside "
                             "llama.cpp's (one stream, 8 streams, the long conversation, both servers)")
    parser.add_argument("--tokens", type=int, help="new tokens per request (default 128; --quick 16)")
    parser.add_argument("--reps", type=int, help="single-stream repetitions (default 5; --quick 2)")
    parser.add_argument("--inprocess-reps", type=int, help="in-process repetitions (default 3; --quick 1)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated stream counts (default 1,2,4,8,16; with --only peer: 8)")
    parser.add_argument("--cancel-reps", type=int, help="cancel repetitions (default 10; --quick 3)")
    parser.add_argument("--cancel-after", type=int, default=5, help="deltas to wait before cancelling")
    parser.add_argument("--history-tokens", type=int, help="history before turn 6 (default 2000; --quick 300)")
    parser.add_argument("--join-prompt-tokens", type=int,
                        help="prompt joining running streams (default 2000; --quick 300)")
    parser.add_argument("--join-tokens", type=int,
                        help="answer length of the running streams (default 256; --quick 64)")
    parser.add_argument("--multiturn-reps", type=int, help="conversations of 6 turns (default 3; --quick 1)")
    parser.add_argument("--prefill-tokens", type=int, help="the prefill phase's message (default 1000; --quick 200)")
    parser.add_argument("--prefill-reps", type=int, help="prefill pairs (default 5; --quick 2)")
    parser.add_argument("--max-batch", type=int, help="the server's CHAT_MAX_BATCH (default: 16, or the largest "
                        "--concurrency); run twice (8 and 16) to compare batch sizes")
    for name in PHASES:
        if name not in ("single", "concurrency"):
            parser.add_argument(f"--skip-{name}", action="store_true", help=f"leave out the {name} phase")
    parser.add_argument("--only-webtier", action="store_true",
                        help="only the web tier's capacity (= --only webtier): no model needed; writes webtier.*")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--webtier-workers", type=ints, default=[1, 4], help="gunicorn workers (default 1,4)")
    parser.add_argument("--webtier-clients", type=ints, default=[8, 32, 128, 256],
                        help="concurrent WebSocket clients (default 8,32,128,256)")
    parser.add_argument("--webtier-rate", type=float, default=50, help="stub tokens/s per stream (default 50)")
    parser.add_argument("--webtier-tokens", type=int, default=300, help="tokens per chat (default 300)")
    parser.add_argument("--webtier-chats", type=int, default=2, help="chats per client in a row (default 2)")
    parser.add_argument("--webtier-first-delay", type=float, default=0.02,
                        help="stub seconds before the first token (default 0.02)")
    parser.add_argument("--temperature", type=float,
                        help="sample every request at this temperature (default: greedy), on both servers")
    parser.add_argument("--top-p", type=float, help="with --temperature: nucleus (default 1.0: off)")
    parser.add_argument("--top-k", type=int, help="with --temperature: top-k (default 0: off)")
    parser.add_argument("--min-p", type=float, help="with --temperature: min-p (default 0: off)")
    parser.add_argument("--unseeded", action="store_true",
                        help="with --temperature: send no seed, as most clients do (a seeded, sampled prompt is "
                             "prefilled on its own, without the shared preamble: docs/models.md)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a phase's wait gives up")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    parser.add_argument("--name", help="output file stem (default latest; webtier with --only webtier)")
    return parser


def resolve(args, parser) -> None:
    """The phases to run (``args.phases``) and every size, from the full or the --quick defaults."""
    only = ["webtier"] if args.only_webtier else args.only
    if only:
        # a preset stands alone (--only peer); beside other phases a name is just its phase
        picked = list(PRESETS.get(only[0], only)) if len(only) == 1 else list(only)
        unknown = [p for p in picked if p not in PHASES]
        if unknown:
            parser.error(f"unknown phase(s) {', '.join(unknown)}: choose from {', '.join(PHASES)}")
        args.phases = [p for p in PHASES if p in picked]
    else:
        args.phases = [p for p in PHASES if not getattr(args, f"skip_{p.replace('-', '_')}", False)]
    args.only_webtier = args.phases == ["webtier"]
    if args.concurrency is None:
        args.concurrency = [peer.STREAMS] if only and "peer" in only else [1, 2, 4, 8, 16]
    defaults = {"tokens": (128, 16), "reps": (5, 2), "inprocess_reps": (3, 1), "cancel_reps": (10, 3),
                "history_tokens": (2000, 300), "multiturn_reps": (3, 1),
                "join_prompt_tokens": (2000, 300), "join_tokens": (256, 64), "prefill_tokens": (1000, 200),
                "prefill_reps": (5, 2)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.name is None:
        args.name = "webtier" if args.only_webtier else "latest"
    if args.temperature is None and ((args.top_p, args.top_k, args.min_p) != (None, None, None) or args.unseeded):
        parser.error("--top-p, --top-k, --min-p and --unseeded sample: give --temperature too")
    workloads.SAMPLING.clear()
    workloads.SEEDED[0] = not args.unseeded
    if args.temperature is not None:  # every request of every phase (seeded as before), this server's and the peer's
        workloads.SAMPLING.update(temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
                                  top_k=args.top_k or 0, min_p=args.min_p or 0.0)


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
    env.setdefault("CHAT_KV_DISK_MB", "256")  # conversations' KV on disk (in the shared cache folder): bounded
    return env


def run_server_phases(res: dict, workdir: Path, env: dict, args) -> None:
    """Every phase that needs this server with the model: start it, run them, stop it."""
    on = set(args.phases)
    srv = BenchServer(workdir, env)
    try:
        print("[bench] starting the server ...", file=sys.stderr, flush=True)
        res["startup"] = {"ready_s": srv.start(timeout=args.timeout)}
        res["startup"]["finished_s"] = phases.wait_finished(srv)  # then the idle chores (crossovers, C++ step)
        res["startup"]["readyz"] = json.loads(http_get(srv.port, "/readyz")[1])
        time.sleep(1.0)  # the worker's memory after start-up settles: what "idle" means in the report
        res["memory"] = {"idle_rss": srv.worker_rss()}
        hello = Client(srv.ws_url)
        res["machine"]["model"] = hello.ready.get("model")
        hello.close()
        ref = None
        if "inprocess" in on and on & {"single", "sampled", "prefill"}:
            print("[bench] loading the paired in-process reference ...", file=sys.stderr, flush=True)
            ref = phases.Reference(env, args)
        try:
            if "single" in on:
                phase(res, "single", phases.run_single, srv, args, False, ref)
            if "single" in on:  # a lone user's new conversations: the first delta of different questions
                phase(res, "questions", workloads.questions, phases.connect(srv, args), args)
            if "sampled" in on:
                phase(res, "sampled", phases.run_single, srv, args, True, ref)
            if "prefill" in on and ref is not None:
                phase(res, "prefill", phases.run_prefill, srv, args, ref)
        finally:
            if ref is not None:
                ref.close()
        if "inprocess" in on:  # the reference again, next to what it is compared with
            phase(res, "inprocess_after", phases.run_inprocess, env, args)
        res["memory"]["warm_idle_rss"] = srv.worker_rss()
        if "concurrency" in on:
            print("[bench] concurrency ...", file=sys.stderr, flush=True)
            res["concurrency"] = phases.run_concurrency(srv, args, res["memory"])
        for name, fn in (("healthz", phases.run_healthz), ("cancel", phases.run_cancel), ("join", phases.run_join),
                         ("multiturn", phases.run_multiturn), ("v1-big", phases.run_v1_big)):
            if name in on:
                phase(res, name.replace("-", "_"), fn, srv, args)
        res["memory"]["end_rss"] = srv.worker_rss()
    except Exception:
        print(srv.log(), file=sys.stderr)
        raise
    finally:
        srv.stop()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve(args, parser)
    on = set(args.phases)
    load_before = os.getloadavg()[0]
    res: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="chat-bench-") as tmp:
        workdir = Path(tmp)
        if args.only_webtier:
            res["machine"] = {**phases.basic_machine(), "loadavg_before": load_before}
            phase(res, "webtier", webtier.run_webtier, workdir, args)
            return write(res, args)
        env = server_env(workdir, args)
        if "inprocess" in on:
            phase(res, "inprocess", phases.run_inprocess, env, args)
        res["machine"] = {**phases.machine_facts(env), "loadavg_before": load_before}
        if on - {"inprocess", "webtier", "peer", "drafts", "restart"}:
            run_server_phases(res, workdir, env, args)
        if "quality" in on:
            phase(res, "quality", phases.run_quality, env, args)
        if "structured" in on:
            phase(res, "structured", phases.run_structured, env, args)
        if "peer" in on:  # alone on the machine, like this server's phases
            phase(res, "peer", peer.run_peer, workdir, args, res["machine"], "multiturn" in on)
        if "drafts" in on:  # servers of its own (drafts on and off) and the peer, one after the other
            phase(res, "drafts", drafts.run_drafts, workdir, env, args, res["machine"])
        if "restart" in on:  # a server of its own, restarted between a conversation's two turns
            phase(res, "restart", restart.run_restart, workdir, env, args)
        if "webtier" in on:
            phase(res, "webtier", webtier.run_webtier, workdir, args)
    res["machine"].setdefault("model", (res.get("inprocess") or {}).get("model"))
    return write(res, args)


def write(res: dict, args) -> int:
    """Targets and figures computed, the report written and printed; 1 when a phase failed."""
    res["targets"] = targets.targets(res)
    res["figures"] = targets.figures(res)
    if args.only_webtier or args.only:  # rows of phases not run would all be empty
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
