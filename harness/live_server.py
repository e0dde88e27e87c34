"""A real gunicorn serving the app on a free port: what the tests and the benchmark share.

Nothing here imports pytest or the benchmark, so either may use it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    """The status of a GET (an HTTP error's too)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


class LiveServer:
    """A real gunicorn (gevent worker) serving ``wsgi:app`` on a free port, in a process group of its own.

    ``env`` is laid over this process's environment (and ``CHAT_BIND``); the log goes to
    ``workdir/server.log``. The tests (conftest.py's ``server_factory``) and the benchmark
    (``bench/server.py``'s ``BenchServer``) both start their servers with this class.
    """

    def __init__(self, workdir: Path, env: dict, start: bool = True, ready_timeout: float = 180) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = {**os.environ, "CHAT_BIND": f"127.0.0.1:{self.port}", "PYTHONUNBUFFERED": "1",
                    **{k: str(v) for k, v in env.items()}}
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.ready_timeout = ready_timeout
        self.ready_s: float | None = None  # seconds from the last spawn to /readyz answering 200
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, wait: bool = True, timeout: float | None = None) -> float | None:
        """Spawn gunicorn; with ``wait``, wait for /readyz and return the seconds it took."""
        with open(self.log_path, "ab") as log:
            self.spawned_at = time.perf_counter()
            self.proc = subprocess.Popen([GUNICORN, "-c", "gunicorn.conf.py", "wsgi:app"], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self.wait_ready(timeout) if wait else None

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll /readyz until it answers 200; the seconds since the spawn."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if _status(self.url + "/readyz") == 200:
                    self.ready_s = time.perf_counter() - self.spawned_at
                    return self.ready_s
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{self.log()}")

    def log(self, chars: int = 6000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def workers(self) -> list:
        """The worker processes (psutil), the children of the gunicorn master."""
        import psutil
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def worker_rss(self) -> int:
        """Resident bytes of every worker process."""
        import psutil
        total = 0
        for child in self.workers():
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Signal the master (SIGTERM: graceful; SIGKILL: the whole group dies, like a crash); the whole
        group is killed if it outlives ``timeout``. Returns the master's exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()
