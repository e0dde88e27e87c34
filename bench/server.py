"""The server under test (a real gunicorn + gevent worker) and a timing chat.v1 client."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from chat.client import Session, collect

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class BenchServer:
    """gunicorn started with extra env on a free port; logs to ``workdir/server.log``."""

    def __init__(self, workdir: Path, env: dict):
        self.port = free_port()
        self.log_path = workdir / "server.log"
        self.env = {**os.environ, "CHAT_BIND": f"127.0.0.1:{self.port}", "PYTHONUNBUFFERED": "1", **env}
        self.proc = None
        self.spawned_at = None

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, timeout: float = 600) -> float:
        """Spawn gunicorn and wait for /readyz 200; returns seconds from spawn to ready."""
        with open(self.log_path, "ab") as log:
            self.spawned_at = time.perf_counter()
            self.proc = subprocess.Popen([GUNICORN, "-c", "gunicorn.conf.py", "wsgi:app"], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = self.spawned_at + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if http_get(self.port, "/readyz", timeout=2)[0] == 200:
                    return time.perf_counter() - self.spawned_at
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def generation_logs(self) -> dict:
        """The server's per-generation log records, by request id."""
        records = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            _, sep, payload = line.partition(" generation {")
            if sep:
                try:
                    record = json.loads("{" + payload)
                except ValueError:
                    continue
                records[record.get("id")] = record
        return records

    def worker_rss(self) -> int:
        """Resident bytes of every worker process (the children of the gunicorn master)."""
        total = 0
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return 0
        for child in children:
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the master (graceful), SIGKILL the whole group if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Client:
    """One chat.v1 connection (``chat.client.Session``) that times a request's frames (perf_counter)."""

    def __init__(self, url: str, timeout: float = 120):
        self.session = Session(url, timeout=timeout, resume=False)
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
