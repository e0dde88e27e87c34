"""``python -m bench.webtier_load``: N concurrent streaming clients in one gevent process; prints one JSON line.

``--mode ws``: each client is one chat.v1 WebSocket doing ``--chats`` chats in a row; ``--mode sse``:
each client POSTs ``stream: true`` chat completions to an OpenAI-compatible URL (the stub upstream
itself, or this server's /v1). Every delta's latency is its receive time minus the stub's send
stamp in its text (``t<monotonic µs> ``), so only a stub upstream can be measured this way.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402  (after patching)
import http.client  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402
import gevent.event  # noqa: E402
import websocket  # noqa: E402

from .stats import percentile  # noqa: E402


def _stamp_latency(text: str, now_us: int) -> int | None:
    """µs between the stub stamping ``text`` and ``now_us``."""
    if text.startswith("t"):
        try:
            return now_us - int(text[1:].strip())
        except ValueError:
            return None
    return None


class Tally:
    """What one client saw: delta latencies, time to first delta per chat, deltas per chat, errors."""

    def __init__(self):
        self.latencies: list[int] = []
        self.ttfd: list[float] = []
        self.rates: list[float] = []
        self.deltas = 0
        self.errors: list[str] = []

    def delta(self, text: str) -> float:
        now = time.monotonic()
        lat = _stamp_latency(text, int(now * 1_000_000))
        if lat is not None:
            self.latencies.append(lat)
        self.deltas += 1
        return now

    def chat_done(self, sent: float, first: float | None, last: float | None, n: int) -> None:
        if first is not None:
            self.ttfd.append(first - sent)
        if first is not None and last is not None and n > 1 and last > first:
            self.rates.append((n - 1) / (last - first))


def ws_client(url: str, chats: int, tokens: int, tally: Tally, start: gevent.event.Event, tag: str) -> None:
    ws = websocket.create_connection(url, timeout=120, suppress_origin=True, enable_multithread=False)
    try:
        json.loads(ws.recv())  # ready
        start.wait()
        for c in range(chats):
            rid = f"{tag}-{c}"
            sent, first, last, n = time.monotonic(), None, None, 0
            ws.send(json.dumps({"type": "chat", "id": rid, "content": "Tell me a story.",
                                "params": {"max_new_tokens": tokens, "temperature": 0}}))
            while True:
                frame = json.loads(ws.recv())
                kind = frame["type"]
                if kind == "delta":
                    last = tally.delta(frame["text"])
                    first = first or last
                    n += 1
                elif kind == "done":
                    if frame["reason"] not in ("length", "stop"):
                        tally.errors.append(f"done {frame['reason']}")
                    break
                elif kind == "error":
                    tally.errors.append(f"error {frame.get('code')}: {frame.get('message')}")
                    break
            tally.chat_done(sent, first, last, n)
    finally:
        ws.close()


def sse_client(url: str, chats: int, tokens: int, tally: Tally, start: gevent.event.Event, tag: str) -> None:
    parts = urlsplit(url)
    body = json.dumps({"model": "stub", "stream": True, "max_tokens": tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a story."}]}).encode()
    start.wait()
    for _ in range(chats):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        sent, first, last, n = time.monotonic(), None, None, 0
        try:
            conn.request("POST", parts.path.rstrip("/") + "/chat/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                tally.errors.append(f"HTTP {resp.status}")
                continue
            while True:
                line = resp.readline()
                if not line or line.startswith(b"data: [DONE]"):
                    break
                if not line.startswith(b"data:"):
                    continue
                for choice in json.loads(line[5:]).get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        last = tally.delta(text)
                        first = first or last
                        n += 1
        finally:
            conn.close()
        tally.chat_done(sent, first, last, n)


def run(mode: str, url: str, clients: int, chats: int, tokens: int) -> dict:
    start = gevent.event.Event()
    tallies = [Tally() for _ in range(clients)]
    target = ws_client if mode == "ws" else sse_client
    greenlets = [gevent.spawn(target, url, chats, tokens, tallies[i], start, f"c{i}") for i in range(clients)]
    gevent.sleep(0.5 if mode == "ws" else 0)  # let the sockets connect and read ready
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    start.set()
    gevent.joinall(greenlets)
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    failed = [repr(g.exception) for g in greenlets if g.exception is not None]
    lat = [v for t in tallies for v in t.latencies]
    ttfd = [v for t in tallies for v in t.ttfd]
    rates = [v for t in tallies for v in t.rates]
    deltas = sum(t.deltas for t in tallies)
    return {"mode": mode, "clients": clients, "chats": chats, "tokens": tokens, "wall_s": wall, "deltas": deltas,
            "deltas_per_s": deltas / wall if wall else None,
            "latency_p50_ms": _ms(percentile(lat, 50), 1e3), "latency_p99_ms": _ms(percentile(lat, 99), 1e3),
            "latency_max_ms": _ms(max(lat, default=None), 1e3),
            "ttfd_p50_ms": _ms(percentile(ttfd, 50), 1e-3), "ttfd_p99_ms": _ms(percentile(ttfd, 99), 1e-3),
            "stream_tok_s_p50": percentile(rates, 50),
            "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "errors": failed + [e for t in tallies for e in t.errors][:5]}


def _ms(value, per_ms: float):
    return None if value is None else value / per_ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.webtier_load", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ws", "sse"), default="ws")
    parser.add_argument("--url", required=True, help="ws://host:port/ws, or an OpenAI base URL .../v1 for sse")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--chats", type=int, default=2, help="chats per client, one after another")
    parser.add_argument("--tokens", type=int, default=150, help="max_new_tokens of each chat")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.mode, args.url, args.clients, args.chats, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
