"""The server under test (harness.LiveServer, the one the tests start too) and a timing chat.v1 client."""
from __future__ import annotations

import contextlib
import http.client
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from chat.client import Session, collect
from harness import ROOT, LiveServer, free_port

__all__ = ["ROOT", "BenchServer", "Client", "Sampler", "free_port", "http_get", "http_post_json", "metric"]


def http_get(port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of one GET on a fresh connection, like a health probe."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def http_post_json(port: int, path: str, body: bytes, timeout: float = 120) -> tuple[int, bytes]:
    """(status, body) of one JSON POST on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metric(port: int, name: str) -> float | None:
    """One unlabelled sample of the server's /metrics (None when absent)."""
    status, body = http_get(port, "/metrics")
    for line in body.decode().splitlines() if status == 200 else []:
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@contextlib.contextmanager
def running(srv, timeout: float) -> Iterator:
    """``srv`` (this server or llama.cpp's: ``start``, ``log``, ``stop``) started for the block, its log
    printed if the block fails, stopped after it."""
    try:
        srv.start(timeout=timeout)
        yield srv
    except Exception:
        print(srv.log(), file=sys.stderr)
        raise
    finally:
        srv.stop()


class BenchServer(LiveServer):
    """The live server as the benchmark starts it: spawned by ``start()`` (which returns the seconds
    from spawn to /readyz answering 200), its settings given whole by the caller."""

    def __init__(self, workdir: Path, env: dict):
        super().__init__(workdir, env, start=False, ready_timeout=600)


class Client:
    """One chat.v1 connection (``chat.client.Session``) that times a request's frames (perf_counter)."""

    def __init__(self, url: str, timeout: float = 120, client_id: str | None = None, source: str | None = None):
        # client_id: its cookie; source: the local address it connects from
        self.session = Session(url, timeout=timeout, resume=False, client_id=client_id, source=source)
        self.ready = self.session.connect()

    def request(self, rid: str, content: str, params: dict, conversation_id: str | None = None,
                cancel_after: int | None = None, on_delta=None) -> dict:
        """Send one chat, read to its ``done``; optionally cancel after that many deltas.

        ``on_delta(n)`` is called after the n-th delta; every delta's arrival time is kept.
        """
        cancel = threading.Event()
        marks = {"deltas": 0, "cancel_sent": None, "after_cancel": 0}
        times = []

        def delta(_text: str) -> None:
            times.append(time.perf_counter())
            marks["deltas"] += 1
            if on_delta is not None:
                on_delta(marks["deltas"])
            if marks["cancel_sent"] is not None:
                marks["after_cancel"] += 1
            elif cancel_after and marks["deltas"] >= cancel_after:
                marks["cancel_sent"] = time.perf_counter()
                cancel.set()  # the session sends the cancel before reading on

        sent = time.perf_counter()
        answer = collect(self.session.chat(content, id=rid, params=params, conversation_id=conversation_id,
                                           cancel=cancel), delta)
        msg, first, now, cancel_sent = answer.done, answer.first_delta_at, answer.done_at, marks["cancel_sent"]
        tokens = msg["usage"]["completion_tokens"]
        return {"id": rid, "conversation_id": answer.start["conversation_id"], "sent": sent, "first": first,
                "done": now, "ttfd_s": first - sent if first else None, "tokens": tokens,
                "prompt_tokens": msg["usage"]["prompt_tokens"], "reason": msg["reason"],
                "tok_s": (tokens - 1) / (now - first) if first and tokens > 1 and now > first else 0.0,
                "server_ttft_ms": msg["timings"].get("ttft_ms"),
                "cancel_to_done_s": now - cancel_sent if cancel_sent else None,
                "deltas_after_cancel": marks["after_cancel"], "delta_times": times}

    def close(self) -> None:
        self.session.close()


class Sampler:
    """Calls ``probe`` every ``interval`` seconds on a thread until stopped; keeps the values."""

    def __init__(self, probe, interval: float):
        self.probe, self.interval = probe, interval
        self.values: list = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.values.append(self.probe())
            except Exception:
                self.errors += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
