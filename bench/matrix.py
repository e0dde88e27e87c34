"""``python -m bench.matrix``: this server beside llama.cpp's server on several model files and CPU classes.

For each CPU class (``native``: this machine's; ``avx512``: ``CHAT_CPU_ISA=avx512``, AVX-512 (with VNNI where
the machine has it) without bf16; ``avx2``: ``CHAT_CPU_ISA=avx2``, llama.cpp built for AVX2 only; torch's
kernels told the class) and each file (the bundled SmolLM2 Q4_1, and a Qwen2.5-0.5B-shaped file in
Q4_K_M, Q8_0 and Q4_0, made by ``bench.qwen_shape`` with llama.cpp's ``llama-quantize``), one ``bench.run``
of the comparison's phases (one stream, 8 streams, the first delta, llama.cpp's server on the same file),
after the raw forward loop at batch 1 and 8 (this path's ceiling, ``bench.inprocess``). Writes
``matrix.json`` and ``matrix.md`` to ``--out``.

    LLAMA_SERVER=/path/native/llama-server LLAMA_SERVER_AVX2=/path/avx2/llama-server python -m bench.matrix

A class whose llama.cpp build is not named is measured without it, except ``avx512``: without
``LLAMA_SERVER_AVX512`` it runs beside the native build (whose products on quantized files are the same
VNNI integer dot products; bf16 instructions serve only BF16 weights), and its row says so.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from chat.engine.kernels import cpu
from chat.engine.model.loader import bundled_gguf

from . import qwen_shape
from .server import ROOT

FILES = {"bundled": None, "qwen-Q4_K_M": "Q4_K_M", "qwen-Q8_0": "Q8_0", "qwen-Q4_0": "Q4_0"}
CLASSES = {"native": "LLAMA_SERVER", "avx512": "LLAMA_SERVER_AVX512", "avx2": "LLAMA_SERVER_AVX2"}


def peer_binary(name: str) -> tuple[str | None, str]:
    """The llama.cpp server a class runs beside, and which build it is."""
    binary = os.environ.get(CLASSES[name])
    if binary or name != "avx512":
        return binary, name
    return os.environ.get(CLASSES["native"]), "native"


def class_env(name: str) -> dict:
    """The environment of every process of a class's runs (the server, the in-process loop)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SERVER", "CHAT_CPU_ISA")}
    for variable in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(variable, None)
    binary, _ = peer_binary(name)
    if binary:
        env["LLAMA_SERVER"] = binary
    if name != "native":
        env["CHAT_CPU_ISA"] = name
        env.update(cpu._TORCH_ENV[name])
    return env


def model_file(name: str, folder: Path) -> Path:
    kind = FILES[name]
    if kind is None:
        return bundled_gguf()
    binaries = [os.environ.get(v) for v in CLASSES.values() if os.environ.get(v)]
    quantize = next((str(Path(b).with_name("llama-quantize")) for b in binaries
                     if Path(b).with_name("llama-quantize").exists()), None)
    return qwen_shape.ensure(kind, folder, quantize)


def one(file: str, klass: str, args) -> dict:
    env = {**class_env(klass), "CHAT_MODEL": str(model_file(file, args.models)), "CHAT_MODEL_NAME": file}
    stem = f"matrix-{file}-{klass}"
    started = time.monotonic()
    print(f"[matrix] {file} on {klass} ...", file=sys.stderr, flush=True)
    raw = _raw_loop(env, args)
    cmd = [sys.executable, "-m", "bench.run", "--only", "single,concurrency,peer", "--reps", str(args.reps),
           "--tokens", str(args.tokens), "--name", stem, "--out", str(args.runs)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout)
    try:
        res = json.loads((args.runs / f"{stem}.json").read_text())
    except (OSError, ValueError) as exc:
        return {"file": file, "class": klass, "error": f"bench.run exited {run.returncode}: {exc}"}
    return {"file": file, "class": klass, "peer_build": peer_binary(klass)[1], **summary(res), **raw,
            "seconds": round(time.monotonic() - started)}


def _raw_loop(env: dict, args) -> dict:
    """The path's ceiling: the engine's own decoder in a plain greedy loop at batch 1 and 8 (bench.inprocess)."""
    cmd = [sys.executable, "-m", "bench.inprocess", "--prompt", "Write a long essay about the history of printing.",
           "--tokens", str(args.raw_tokens), "--reps", "1", "--batches", "1,8"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    try:
        raw = json.loads(out.stdout.strip().splitlines()[-1])["raw"]
    except (IndexError, KeyError, ValueError):
        return {"raw_error": out.stderr[-500:]}
    return {"raw_1": (raw.get("1") or {}).get("tok_s"), "raw_8": (raw.get("8") or {}).get("tok_s")}


def summary(res: dict) -> dict:
    single, peer = res.get("single") or {}, res.get("peer") or {}
    eight = next((r for r in res.get("concurrency") or [] if r.get("streams") == 8 and "error" not in r), {})
    ready = (res.get("startup") or {}).get("readyz") or {}
    return {"ours_1": single.get("tok_s_p50"), "peer_1": (peer.get("single") or {}).get("tok_s_p50"),
            "ours_8": eight.get("aggregate_tok_s"), "peer_8": (peer.get("streams") or {}).get("aggregate_tok_s"),
            "ours_ttfd_ms": _ms(single.get("ttfd_p50_s")),
            "peer_ttfd_ms": _ms((peer.get("single") or {}).get("ttfd_p50_s")),
            "ours_new_ms": _ms((res.get("questions") or {}).get("ttfd_p50_s")),
            "peer_new_ms": _ms((peer.get("questions") or {}).get("ttfd_p50_s")),
            "ready_s": (res.get("startup") or {}).get("ready_s"),
            "idle_rss_mib": _mib((res.get("memory") or {}).get("idle_rss")),
            "weights": ready.get("weights"), "formats": ready.get("formats"), "decode": ready.get("decode"),
            "cpu": ready.get("cpu"), "peer_error": peer.get("error") or peer.get("skipped")}


def _ms(v):
    return round(v * 1000, 1) if v is not None else None


def _mib(v):
    return round(v / 2**20) if v else None


def _ratio(a, b):
    return f"{a / b:.2f}" if a and b else "—"


def _f(v):
    return "—" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| file | class | ours 1 stream | llama.cpp 1 | ratio | ours 8 streams | llama.cpp 8 | ratio | "
             "first delta ours / llama.cpp ms: same prompt again | new short questions (median) | "
             "raw loop b1 / b8 tok/s | ready s | idle RSS MiB | decode |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        r.setdefault("raw_1", None)
        r.setdefault("raw_8", None)
        if "error" in r:
            lines.append(f"| {r['file']} | {r['class']} | {r['error']} ||||||||||||")
            continue
        klass = r["cpu"] or r["class"]
        if r.get("peer_build", r["class"]) != r["class"]:
            klass += f" (llama.cpp: {r['peer_build']} build)"
        lines.append(f"| {r['file']} | {klass} | {_f(r['ours_1'])} | {_f(r['peer_1'])} | "
                     f"{_ratio(r['ours_1'], r['peer_1'])} | {_f(r['ours_8'])} | {_f(r['peer_8'])} | "
                     f"{_ratio(r['ours_8'], r['peer_8'])} | {_f(r['ours_ttfd_ms'])} / {_f(r['peer_ttfd_ms'])} | "
                     f"{_f(r.get('ours_new_ms'))} / {_f(r.get('peer_new_ms'))} | "
                     f"{_f(r['raw_1'])} / {_f(r['raw_8'])} | {_f(r['ready_s'])} | {_f(r['idle_rss_mib'])} | "
                     f"{r['weights']}, {r['decode']} |")
    formats = {r["file"]: r.get("formats") for r in rows if r.get("formats")}
    lines += ["", "Formats per product (decode): " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in f.items()) for name, f in formats.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated: {', '.join(FILES)}")
    machine = cpu.CLASSES.index(cpu.detect().machine)
    below = [name for name in CLASSES if name == "native" or cpu.CLASSES.index(name) < machine]
    parser.add_argument("--classes", default=",".join(below),
                        help=f"comma-separated: {', '.join(CLASSES)} (default: native and those below it)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--raw-tokens", type=int, default=64, help="tokens of the raw loop (the ceiling)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--models", type=Path, default=ROOT / "data" / "bench-models",
                        help="where the Qwen-shaped files are made and kept")
    parser.add_argument("--runs", type=Path, default=ROOT / "data" / "bench-matrix",
                        help="where each run's own report goes")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where matrix.md/json go")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    rows = [one(file, klass, args) for klass in args.classes.split(",") for file in args.files.split(",")]
    (args.out / "matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = markdown(rows)
    (args.out / "matrix.md").write_text(md)
    print(md)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
