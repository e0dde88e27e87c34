"""llama.cpp's own server beside this one: the same GGUF, the same workloads, through its
OpenAI-compatible streaming ``/v1/chat/completions``.

It runs when ``LLAMA_SERVER`` names a ``llama-server`` binary (build one with
``OUT=DIR ../shared/peers/build-llamacpp.sh``); without it the report says the peer was skipped.
The GGUF is the one this server loads (``chat.engine.model.loader`` finds it: the bundled model, or
``CHAT_MODEL`` when that is a ``.gguf`` file). llama.cpp runs as ``-t 2 --parallel 8 -c 16384
--kv-unified``.
"""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from . import workloads
from .server import free_port, http_get

# One KV pool of 16384 tokens shared by the 8 slots (--kv-unified, llama.cpp's own default when it picks
# the slot count): without it each slot gets 16384 / 8 = 2048 and refuses the long conversation's turn 6.
LLAMA_ARGS = ["-t", "2", "--parallel", "8", "-c", "16384", "--kv-unified"]
STREAMS = 8  # the "8 users" of the comparison


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench process that started it ends, however it ends (a
    killed bench left its servers generating on a core, spoiling the next runs' timings). Linux only."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LlamaServer:
    """``llama-server`` on a free port, its log in ``workdir/llama-server.log``."""

    def __init__(self, binary: str, gguf: str, workdir: Path):
        self.port = free_port()
        self.cmd = [binary, "-m", gguf, *LLAMA_ARGS, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = Path(workdir) / "llama-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> float:
        """Spawn it and wait for ``/health`` 200 (the model loaded); the seconds that took."""
        with open(self.log_path, "ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_end_with_parent)
        deadline = started + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if http_get(self.port, "/health", timeout=2)[0] == 200:
                    return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not ready in {timeout:.0f} s:\n{self.log()}")

    def build(self) -> str | None:
        """Its build, as ``/props`` reports it."""
        try:
            status, body = http_get(self.port, "/props", timeout=5)
            return json.loads(body).get("build_info") if status == 200 else None
        except (OSError, ValueError):
            return None

    def log(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PeerClient:
    """An OpenAI-compatible streaming client timed like ``bench.server.Client``. The server keeps no
    conversations, so this client does: each ``conversation_id`` is the messages sent so far. Each
    request goes on a fresh connection (llama-server closes one after a streamed answer)."""

    conversations: dict = {}  # shared by the clients of one run, like a server's store

    def __init__(self, port: int, system_prompt: str, timeout: float = 600):
        self.port, self.system, self.timeout = port, system_prompt, timeout

    def request(self, rid: str, content: str, params: dict, conversation_id: str | None = None,
                cancel_after: int | None = None, on_delta=None) -> dict:
        """Send one chat completion, streamed, and read it to its end; the same timings as ours."""
        history = self.conversations.get(conversation_id) or [{"role": "system", "content": self.system}]
        messages = history + [{"role": "user", "content": content}]
        body = {"model": "peer", "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": params["max_new_tokens"], "temperature": params.get("temperature", 0.7),
                "top_p": params.get("top_p", 1.0), "top_k": params.get("top_k", 0), "min_p": params.get("min_p", 0.0)}
        if params.get("seed") is not None:
            body["seed"] = params["seed"]
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            sent = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
            times, text, usage, timings, reason = [], [], {}, {}, None
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
                        if on_delta is not None:
                            on_delta(len(times))
                    reason = choice.get("finish_reason") or reason
            done = time.perf_counter()
        finally:
            conn.close()
        conversation_id = conversation_id or uuid.uuid4().hex
        self.conversations[conversation_id] = messages + [{"role": "assistant", "content": "".join(text)}]
        tokens = usage.get("completion_tokens") or len(times)
        first = times[0] if times else None
        return {"id": rid, "conversation_id": conversation_id, "sent": sent, "first": first, "done": done,
                "ttfd_s": first - sent if first else None, "tokens": tokens,
                "prompt_tokens": usage.get("prompt_tokens") or timings.get("prompt_n"),
                "reused_tokens": timings.get("cache_n"), "reason": reason,
                "tok_s": (tokens - 1) / (done - first) if first and tokens > 1 and done > first else 0.0,
                "server_ttft_ms": timings.get("prompt_ms"), "delta_times": times}

    def close(self) -> None:
        pass


def run_peer(workdir: Path, args, machine: dict, multiturn: bool = True) -> dict:
    """The peer's single stream, 8 streams and long conversation, or why it was skipped."""
    binary = os.environ.get("LLAMA_SERVER")
    if not binary:
        return {"skipped": "LLAMA_SERVER is not set (it names a llama-server binary)"}
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise RuntimeError(f"LLAMA_SERVER={binary} is not an executable file")
    if not machine.get("gguf"):
        return {"skipped": "the model is not a GGUF file (CHAT_MODEL names a hub id or a folder)"}
    srv = LlamaServer(binary, machine["gguf"], workdir)
    out: dict = {"binary": binary, "gguf": machine["gguf"], "args": " ".join(LLAMA_ARGS)}
    try:
        out["ready_s"] = srv.start(timeout=args.timeout)
        out["build"] = srv.build()

        def connect(user: int | None = None):  # llama.cpp's server does not tell clients apart
            return PeerClient(srv.port, machine.get("system_prompt") or "", args.timeout)

        PeerClient.conversations = {}
        out["single"] = workloads.single(connect, args, "peer-single")
        out["single"].pop("paired")
        print(f"  peer one stream: {out['single']['tok_s_p50']:.1f} tok/s", file=sys.stderr, flush=True)
        out["questions"] = workloads.questions(connect, args, "peer-questions")
        out["streams"] = workloads.streams(connect, STREAMS, args, "peer")
        print(f"  peer {STREAMS} streams: {out['streams']['aggregate_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        if multiturn:
            out["multiturn"] = workloads.multiturn(connect, args)
    except Exception:
        print(srv.log(), file=sys.stderr)
        raise
    finally:
        srv.stop()
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def comparison(res: dict) -> list[tuple]:
    """(what, ours, llama.cpp's, ours ÷ llama.cpp's, goal) rows, the same workloads side by side."""
    p = res.get("peer") or {}
    if "single" not in p:
        return []
    ours_single, ours_multi = res.get("single") or {}, res.get("multiturn") or {}
    ours8 = next((r for r in res.get("concurrency") or [] if r.get("streams") == STREAMS and "error" not in r), {})
    p_single, p8, p_multi = p.get("single") or {}, p.get("streams") or {}, p.get("multiturn") or {}

    def ms(v):
        return v * 1000 if v is not None else None

    rows = [("one stream, delivered tok/s (p50)", ours_single.get("tok_s_p50"), p_single.get("tok_s_p50"), "≥ 0.8"),
            ("one stream, first delta ms (p50), the same prompt again", ms(ours_single.get("ttfd_p50_s")),
             ms(p_single.get("ttfd_p50_s")), "≤ 1.5"),
            ("a new conversation's short question, first delta ms (median of 8 different)",
             ms((res.get("questions") or {}).get("ttfd_p50_s")), ms((p.get("questions") or {}).get("ttfd_p50_s")),
             "≤ 1.5"),
            (f"{STREAMS} streams, aggregate tok/s", ours8.get("aggregate_tok_s"), p8.get("aggregate_tok_s"), "≥ 1.0"),
            (f"{STREAMS} streams, per-stream tok/s (p50)", ours8.get("stream_tok_s_p50"), p8.get("stream_tok_s_p50"),
             ""),
            (f"first delta with {STREAMS} users, p50 ms", ms(ours8.get("ttfd_p50_s")), ms(p8.get("ttfd_p50_s")), ""),
            (f"first delta with {STREAMS} users, p95 ms", ms(ours8.get("ttfd_p95_s")), ms(p8.get("ttfd_p95_s")), ""),
            ("long conversation: turn 1 first delta ms", ms(ours_multi.get("ttfd_turn1_s")),
             ms(p_multi.get("ttfd_turn1_s")), ""),
            ("long conversation: turn 6 first delta ms", ms(ours_multi.get("ttfd_turn6_s")),
             ms(p_multi.get("ttfd_turn6_s")), "≤ 0.5"),
            ("turn 6 prompt tokens", ours_multi.get("turn6_prompt_tokens"), p_multi.get("turn6_prompt_tokens"), ""),
            ("turn 6 prompt tokens reused from a cache", ours_multi.get("turn6_reused_tokens"),
             p_multi.get("turn6_reused_tokens"), ""),
            ("start-up to ready s", (res.get("startup") or {}).get("ready_s"), p.get("ready_s"), "")]
    return [(name, ours, theirs, _ratio(ours, theirs), goal) for name, ours, theirs, goal in rows]


def targets(res: dict, row) -> list[dict]:
    """The goals against llama.cpp's server, measured in the same run (none when it was skipped)."""
    rows = {name: value for name, _, _, value, _ in comparison(res)}
    if not rows:
        return []
    return [row("one stream ÷ llama.cpp's server (delivered tok/s)", rows["one stream, delivered tok/s (p50)"],
                "≥ 0.8", lambda v: v >= 0.8),
            row(f"{STREAMS} streams aggregate ÷ llama.cpp's server", rows[f"{STREAMS} streams, aggregate tok/s"],
                "≥ 1.0", lambda v: v >= 1.0),
            row("a new conversation's first delta ÷ llama.cpp's, the same prompt again",
                rows["one stream, first delta ms (p50), the same prompt again"], "≤ 1.5", lambda v: v <= 1.5),
            row("a new conversation's first delta ÷ llama.cpp's, 8 different short questions (median)",
                rows["a new conversation's short question, first delta ms (median of 8 different)"], "≤ 1.5",
                lambda v: v <= 1.5),
            row("turn 6 first delta ÷ llama.cpp's server's turn 6",
                rows["long conversation: turn 6 first delta ms"], "≤ 0.5", lambda v: v <= 0.5)]


def markdown(res: dict) -> list[str]:
    """The side-by-side table, or the line saying why the peer was not measured."""
    p = res.get("peer")
    if p is None:
        return []
    if "skipped" in p or "error" in p:
        return ["", f"llama.cpp's server: not measured ({p.get('skipped') or p.get('error')})."]

    def f(v):
        if v is None:
            return "—"
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 100 else f"{v:.0f}" if isinstance(v, float) else str(v)

    lines = ["", f"llama.cpp's server beside this one: `llama-server {p['args']}` (build {p.get('build') or '?'}), "
                 f"the same GGUF (`{Path(p['gguf']).name}`) and workloads, streamed through its `/v1/chat/completions` "
                 "(this server's rows are the phases above, over the WebSocket):", "",
             "| same workload | this server | llama.cpp | ours ÷ llama.cpp | goal |", "|---|---|---|---|---|"]
    for name, ours, theirs, ratio, goal in comparison(res):
        lines.append(f"| {name} | {f(ours)} | {f(theirs)} | {f(ratio)} | {goal} |")
    return lines
