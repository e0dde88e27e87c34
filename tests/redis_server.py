"""A real redis-server (Debian's package) for the tests: a temporary directory, a free local port."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from helpers import free_port


class RedisServer:
    """``start()``/``stop()``/``restart()`` a redis-server without persistence (a restart loses all)."""

    def __init__(self):
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not shutil.which(binary):
            raise RuntimeError("redis-server is not installed: `make system-deps` installs it")
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="chat-redis-")
        self.port = free_port()
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--logfile", f"{self.dir}/redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
