"""The restart phase: turn 2 of a long conversation after the server restarted (its first turn's KV read back from
disk, ``CHAT_KV_DISK_MB``) against turn 2 of a conversation whose KV is warm in memory, on a server of its own
with a data folder that lives across the restart. Both turns' first deltas are the medians of
``--multiturn-reps`` conversations (each: a ~``--history-tokens`` first message of meeting notes, then a short
question)."""
from __future__ import annotations

import sys
from pathlib import Path

from . import phases, workloads
from .server import BenchServer, Client
from .stats import percentile

QUESTION = "Which of these points matters most, and why?"
IDENTITY = "bench-restart-client-0001"  # one person's cookie across the restart: their conversations


def _turn1(client: Client, tag: str, args, n: int) -> str:
    r = client.request(f"{tag}-1", workloads.notes_message(n, args.history_tokens), workloads.params(32))
    return r["conversation_id"]


def _turn2(client: Client, tag: str, conversation: str) -> dict:
    return client.request(f"{tag}-2", QUESTION, workloads.params(16), conversation_id=conversation)


def run_restart(workdir: Path, env: dict, args) -> dict:
    srv = BenchServer(workdir / "restart", env)
    try:
        srv.start(timeout=args.timeout)
        phases.wait_finished(srv)
        client = Client(srv.ws_url, timeout=args.timeout, client_id=IDENTITY)
        warm, later = [], []
        for i in range(args.multiturn_reps):
            # each conversation its own notes: no other conversation's KV serves it
            warm.append(_turn2(client, f"warm-{i}", _turn1(client, f"warm-{i}", args, 20 * i + 1)))
            later.append(_turn1(client, f"cold-{i}", args, 20 * i + 11))  # its turn 2 comes after the restart
        client.close()
        srv.stop()
        srv.start(timeout=args.timeout)
        phases.wait_finished(srv)
        client = Client(srv.ws_url, timeout=args.timeout, client_id=IDENTITY)  # the same person, after the restart
        client.request("restart-warmup", "Say hello.", workloads.params(4))
        after = [_turn2(client, f"cold-{i}", conversation) for i, conversation in enumerate(later)]
        client.close()
    except Exception:
        print(srv.log(), file=sys.stderr)
        raise
    finally:
        srv.stop()
    warm_ms = 1000 * percentile([r["ttfd_s"] for r in warm], 50)
    after_ms = 1000 * percentile([r["ttfd_s"] for r in after], 50)
    return {"warm_turn2_ms": warm_ms, "restart_turn2_ms": after_ms, "ratio": after_ms / warm_ms,
            "turn2_prompt_tokens": after[-1].get("prompt_tokens"), "conversations": len(after),
            "runs": [{k: r.get(k) for k in ("id", "ttfd_s", "server_ttft_ms", "prompt_tokens", "tokens")}
                     for r in warm + after]}
