"""The drafts phase: one stream with drafted tokens (``CHAT_DRAFT=ngram``, the default) against the same server
without them (``off``) and llama.cpp's server (no drafts), on two workloads: "edit" (the answer quotes a
~300-token attachment with a small change: where drafts pay) and "story" (the essay of the other phases:
where they must cost nothing). Each of our two modes is a server of its own, started in turn; the
accepted tokens per step come from ``/readyz``'s counts."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import phases, workloads
from .peer import LlamaServer, PeerClient
from .server import BenchServer, Client, http_get, running

EDIT_TOKENS = 300


def _workloads(connect, args, tag: str) -> dict:
    out = {"edit": workloads.single(connect, args, f"{tag}-edit", prompt=workloads.edit_prompt(), tokens=EDIT_TOKENS),
           "story": workloads.single(connect, args, f"{tag}-story")}
    for result in out.values():
        result.pop("paired")
    return out


def _ours(workdir: Path, env: dict, args, mode: str) -> dict:
    with running(BenchServer(workdir / f"drafts-{mode}", {**env, "CHAT_DRAFT": mode}), args.timeout) as srv:
        phases.wait_finished(srv)
        before = json.loads(http_get(srv.port, "/readyz")[1])
        out = _workloads(lambda user=None: Client(srv.ws_url, timeout=args.timeout), args, mode)
        after = json.loads(http_get(srv.port, "/readyz")[1])
    for name in ("draft_steps", "draft_accepted_tokens", "drafted_tokens"):
        out[name] = after.get(name, 0) - before.get(name, 0)
    steps = out["draft_steps"]
    out["tokens_per_draft_step"] = (steps + out["draft_accepted_tokens"]) / steps if steps else None
    print(f"  drafts {mode}: edit {out['edit']['tok_s_p50']:.1f} tok/s, story {out['story']['tok_s_p50']:.1f}",
          file=sys.stderr, flush=True)
    return out


def _peer(workdir: Path, args, machine: dict) -> dict:
    binary = os.environ.get("LLAMA_SERVER")
    if not binary or not machine.get("gguf"):
        return {"skipped": "LLAMA_SERVER is not set, or the model is not a GGUF file"}
    with running(LlamaServer(binary, machine["gguf"], workdir), args.timeout) as srv:
        return _workloads(lambda user=None: PeerClient(srv.port, machine.get("system_prompt") or "", args.timeout),
                          args, "peer")


def run_drafts(workdir: Path, env: dict, args, machine: dict) -> dict:
    """Both of our modes and the peer on the two workloads, and the ratios the targets read."""
    out = {mode: _ours(workdir, env, args, mode) for mode in ("ngram", "off")}
    out["peer"] = _peer(workdir, args, machine)

    def rate(side: str, name: str):
        return ((out.get(side) or {}).get(name) or {}).get("tok_s_p50")

    def ratio(a, b):
        return a / b if a and b else None

    out["edit_ratio_off"] = ratio(rate("ngram", "edit"), rate("off", "edit"))
    out["edit_ratio_peer"] = ratio(rate("ngram", "edit"), rate("peer", "edit"))
    out["story_ratio_off"] = ratio(rate("ngram", "story"), rate("off", "story"))
    return out
