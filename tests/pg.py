"""A real PostgreSQL for the tests: initdb in a temporary folder, a free local port, one fresh
schema per test. Binaries missing is a failure, not a skip: `make system-deps` installs them."""
from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from helpers import free_port

BACKENDS = ["sqlite", "postgresql"]


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin: "
                           "run `make system-deps`")
    return Path(found[-1]).parent



class PostgresServer:
    """One cluster, run as the `postgres` user when we are root (PostgreSQL refuses root)."""

    def __init__(self):
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="chat-pg-"))
        self.data, self.port = self.root / "data", free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres", "postgres")
        self._names = itertools.count()
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--locale=C.UTF-8", "--no-sync")
        # Durability is not what the tests check: no fsync makes CREATE DATABASE and commits cheap.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.root / "log"),
                  "-o", options)
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "chat")

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(self._as + [str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_schema(self) -> str:
        """The URL of a new, empty schema of the database `chat`: its search_path leads there, so a
        store sees it as a database of its own (a schema costs milliseconds, a database 0.25 s)."""
        import psycopg
        name = f"test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url("chat"), autocommit=True) as chat:
            chat.execute(f"CREATE SCHEMA {name}")
        return self.url("chat") + f"?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-m", "immediate", "-w", "-D", str(self.data))
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def database(request, kind: str, path) -> str:
    """Where a test's store lives: the SQLite file ``path``, or a fresh PostgreSQL schema."""
    if kind == "sqlite":
        return str(path)
    return request.getfixturevalue("postgres").new_schema()
