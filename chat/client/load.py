"""The load generator: many concurrent chats over the session library, summarised."""
from __future__ import annotations

import math
import threading
import time

from .session import ChatTimeout, ClientError, ConnectFailed, ServerError, Session, collect


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_load(url: str, *, concurrency: int, requests: int, prompt: str, params: dict | None = None,
             system: str | None = None, timeout: float = 60.0, api_key: str | None = None) -> dict:
    """Run ``requests`` chats over ``concurrency`` sockets; returns the summary (see ``load``)."""
    lock = threading.Lock()
    counter = iter(range(requests))
    results: list[dict] = []

    def take() -> int | None:
        with lock:
            return next(counter, None)

    def worker() -> None:
        session = Session(url, api_key=api_key, timeout=timeout)
        try:
            while take() is not None:
                row = None
                if session.ws is None:  # first use, or the last request lost the socket
                    try:
                        session.connect()
                    except ChatTimeout as exc:
                        row = {"ok": False, "error": "timeout", "message": str(exc)}
                    except ClientError as exc:
                        row = {"ok": False, "error": "connect", "message": str(exc)}
                row = row or _one_load_request(session, prompt, params, system)
                with lock:
                    results.append(row)
        finally:
            session.close()

    started = time.monotonic()
    threads = [threading.Thread(target=worker, name=f"load-{n}", daemon=True)
               for n in range(min(concurrency, requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return _summary(results, wall, concurrency, requests)


def _one_load_request(session: Session, prompt: str, params: dict | None, system: str | None) -> dict:
    """One timed chat; the result row ``run_load`` aggregates."""
    sent = time.perf_counter()
    try:
        answer = collect(session.chat(prompt, params=params or None, system=system))
    except ServerError as exc:
        return {"ok": False, "error": exc.code, "message": exc.message}
    except ChatTimeout as exc:
        return {"ok": False, "error": "timeout", "message": str(exc)}
    except ConnectFailed as exc:
        return {"ok": False, "error": "connection_lost", "message": str(exc)}
    except ClientError as exc:
        return {"ok": False, "error": "client", "message": str(exc)}
    if answer.done is None:
        return {"ok": False, "error": "no_done", "message": "the stream ended without done"}
    reason, first, end = answer.done.get("reason"), answer.first_delta_at, answer.done_at
    assert end is not None  # set with done
    deltas = len(answer.pieces)
    tokens = (answer.done.get("usage") or {}).get("completion_tokens") or deltas
    row = {"ok": reason in ("stop", "length"), "reason": reason, "tokens": tokens, "deltas": deltas,
           "total_s": end - sent, "ttft_s": None if first is None else first - sent,
           "decode_tokens_per_s": (tokens - 1) / (end - first)
           if first is not None and tokens > 1 and end > first else None}
    if not row["ok"]:
        row["error"] = f"done:{reason}"
    return row


def _summary(results: list[dict], wall: float, concurrency: int, requests: int) -> dict:
    """Aggregate per-request rows into the load report."""
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] * 1000 for r in ok if r.get("ttft_s") is not None]
    rates = [r["decode_tokens_per_s"] for r in ok if r.get("decode_tokens_per_s") is not None]
    tokens = sum(r.get("tokens", 0) for r in results if "tokens" in r)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    rnd = lambda v, n=1: None if v is None else round(v, n)  # noqa: E731
    return {
        "requests": requests, "concurrency": concurrency, "ok": len(ok),
        "failed": len(results) - len(ok), "wall_s": rnd(wall, 3),
        "ttft_ms": {"p50": rnd(_percentile(ttfts, 50)), "p95": rnd(_percentile(ttfts, 95)),
                    "max": rnd(max(ttfts) if ttfts else None)},
        "stream_tokens_per_s": {"p50": rnd(_percentile(rates, 50)),
                                "min": rnd(min(rates) if rates else None),
                                "max": rnd(max(rates) if rates else None),
                                "mean": rnd(sum(rates) / len(rates) if rates else None)},
        "completion_tokens": tokens,
        "aggregate_tokens_per_s": rnd(tokens / wall if wall > 0 else None),
        "errors": errors,
    }


def print_summary(s: dict) -> None:
    """The human-readable load report."""
    fmt = lambda v, unit="": "-" if v is None else f"{v:g}{unit}"  # noqa: E731
    t, r = s["ttft_ms"], s["stream_tokens_per_s"]
    print(f"requests: {s['ok']} ok, {s['failed']} failed of {s['requests']} "
          f"(concurrency {s['concurrency']}) in {s['wall_s']:.2f} s")
    print(f"time to first delta: p50 {fmt(t['p50'], ' ms')}  p95 {fmt(t['p95'], ' ms')}  "
          f"max {fmt(t['max'], ' ms')}")
    print(f"tokens/s per stream (after the first delta): p50 {fmt(r['p50'])}  min {fmt(r['min'])}  "
          f"max {fmt(r['max'])}  mean {fmt(r['mean'])}")
    print(f"aggregate: {s['completion_tokens']} tokens, {fmt(s['aggregate_tokens_per_s'])} tokens/s")
    errors = ", ".join(f"{k}={v}" for k, v in sorted(s["errors"].items())) or "none"
    print(f"errors: {errors}")
