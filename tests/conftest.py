"""Fixtures: the app in-process with a fake engine (fast), live gunicorn + gevent servers with a
tiny real model (end to end), WebSocket clients."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import websocket

from fakes import AppServer, FakeEngine
from pg import BACKENDS, PostgresServer, database
from tinymodel import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10, headers=None):
    """(status, headers, body bytes) of a GET, errors included."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


class LiveServer:
    """A real gunicorn (gevent worker) serving the app, logs in ``log_path``."""

    def __init__(self, workdir: Path, env: dict):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = {**os.environ, "CHAT_DATA_DIR": str(workdir / "data"), "CHAT_DTYPE": "float32",
                    "CHAT_BIND": f"127.0.0.1:{self.port}", "CHAT_RATE_LIMIT_PER_MIN": "0",
                    # every test client comes from 127.0.0.1: per-address limits only where a test sets them
                    "CHAT_RATE_LIMIT_PER_IP_PER_MIN": "0", "CHAT_MAX_ACTIVE_PER_IP": "0",
                    # one torch thread: on a shared 2-core box a 2-thread team stalls on every op
                    "CHAT_THREADS": "1",
                    "CHAT_GRACEFUL_TIMEOUT_S": "5", "PYTHONUNBUFFERED": "1",
                    "CHAT_CACHE_DIR": str(ROOT / "data" / "model-cache"), **env}
        self.log_path = workdir / "server.log"
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, wait: bool = True) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([GUNICORN, "-c", "gunicorn.conf.py", "wsgi:app"], cwd=ROOT,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if http_get(self.url + "/readyz", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        if sig == signal.SIGKILL:  # like a crash: the workers die with the master
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


class WS:
    """A test WebSocket client speaking chat.v1 (a real client: websocket-client)."""

    def __init__(self, url: str, timeout: float = 30, **kwargs):
        self.conn = websocket.create_connection(url, timeout=timeout, **kwargs)
        self.ready = self.recv()
        assert self.ready["type"] == "ready", self.ready

    def send(self, frame) -> None:
        self.conn.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame),
                       opcode=websocket.ABNF.OPCODE_BINARY if isinstance(frame, bytes) else websocket.ABNF.OPCODE_TEXT)

    def recv(self) -> dict:
        return json.loads(self.conn.recv())

    def until(self, predicate, limit: int = 100000) -> list[dict]:
        """Frames received up to and including the first that matches."""
        frames = []
        for _ in range(limit):
            frame = self.recv()
            frames.append(frame)
            if predicate(frame):
                return frames
        raise AssertionError(f"no matching frame in {frames[-5:]}")

    def chat(self, content: str, rid: str = "r1", **fields) -> list[dict]:
        """Send a chat and return every frame up to its ``done`` (or its error)."""
        self.send({"type": "chat", "id": rid, "content": content, **fields})
        return self.until(lambda f: f.get("id") == rid and f["type"] in ("done", "error"))

    def ping(self) -> dict:
        self.send({"type": "ping", "t": 7})
        return self.until(lambda f: f["type"] == "pong")[-1]

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


def text_of(frames) -> str:
    """The answer: every delta's text in index order."""
    deltas = sorted((f for f in frames if f["type"] == "delta"), key=lambda f: f["index"])
    assert [f["index"] for f in deltas] == list(range(len(deltas))), "delta indexes have gaps"
    return "".join(f["text"] for f in deltas)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A small random Qwen2 model folder, built once."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory, tiny_model):
    """Start real gunicorn servers with extra env; all are stopped at the end of the session."""
    servers = []

    def start(name: str = "srv", **env) -> LiveServer:
        env = {"CHAT_MODEL": str(tiny_model), **{k: str(v) for k, v in env.items()}}
        srv = LiveServer(tmp_path_factory.mktemp(name), env)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop(signal.SIGKILL if srv.proc and srv.proc.poll() is None else signal.SIGTERM, timeout=10)


@pytest.fixture(scope="session")
def gunicorn_server(server_factory) -> LiveServer:
    """The shared real server: tiny model, long answers allowed."""
    # Answers count per client across its connections: room for eight parallel streams of one cookie.
    return server_factory("shared", CHAT_MAX_NEW_TOKENS=4096, CHAT_CONTEXT_TOKENS=8192,
                          CHAT_RESUME_GRACE_S=3, CHAT_MAX_ACTIVE_PER_CONNECTION=8)


@pytest.fixture(scope="session")
def server(gunicorn_server) -> LiveServer:
    """The server ``ws`` talks to; a module may override it with ``app_server``."""
    return gunicorn_server


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL cluster for the session (see pg.py); fails when its binaries are missing."""
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=BACKENDS)
def db_backend(request) -> str:
    """Each store test runs on SQLite and on PostgreSQL."""
    return request.param


@pytest.fixture
def db_path(request, db_backend, tmp_path) -> str:
    """A fresh database of ``db_backend``: an SQLite file (in folders not made yet), or a PostgreSQL URL."""
    return database(request, db_backend, tmp_path / "nested" / "dir" / "chat.db")


@pytest.fixture(scope="session")
def app_factory(tmp_path_factory):
    """Serve ``create_app(settings, engine=FakeEngine(...), store=Store(tmp))`` in this process
    (``db=<postgresql URL>`` puts the store there)."""
    from chat import create_app
    from chat.config import Settings
    from chat.store import Store
    servers = []

    def start(engine: FakeEngine | None = None, **settings) -> AppServer:
        data = tmp_path_factory.mktemp("app")
        settings = {"max_new_tokens": 4096, "context_tokens": 8192, "resume_grace_s": 2,
                    "rate_limit_per_min": 0, "rate_limit_per_ip_per_min": 0, "max_active_per_ip": 0,
                    "max_active_per_connection": 8, "data_dir": str(data), **settings}
        engine = engine or FakeEngine(answer_words=100_000, delay=0.001, seeded=True)
        settings = Settings(**settings)
        store = None if settings.engine_only else Store(settings.db_path)  # an engine opens none
        srv = AppServer(create_app(settings, engine=engine, store=store))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.state.engine.shutdown()
        srv.close()


@pytest.fixture(scope="session")
def app_server(app_factory) -> AppServer:
    """The shared in-process server: fake engine (words, 1 ms apart, until cancelled or max tokens)."""
    return app_factory()


@pytest.fixture
def ws(server):
    """A connected WebSocket client on the shared server."""
    client = WS(server.ws_url)
    yield client
    client.close()


def start_of(frames) -> dict:
    """The ``start`` frame among a request's frames (``queued`` may come first on a busy server)."""
    return next(f for f in frames if f["type"] == "start")


def conv_of(frames) -> str:
    return start_of(frames)["conversation_id"]


def in_threads(target, count: int, timeout: float = 120) -> None:
    """Run ``target(i)`` for i in range(count) on parallel threads and wait for all."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def cookie_for(server) -> str:
    """A browser-like identity: the cookie GET / hands out."""
    status, headers, _ = http_get(server.url + "/")
    assert status == 200
    return headers["Set-Cookie"].split(";")[0]


def conversation(server, cookie, conv):
    """(status, body) of GET /api/conversations/<conv> as the client with ``cookie``."""
    status, _, body = http_get(f"{server.url}/api/conversations/{conv}", headers={"Cookie": cookie})
    return status, json.loads(body)


def wait_settled(server, cookie, conv, timeout=30):
    """The conversation once its last answer is no longer streaming."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = conversation(server, cookie, conv)[1]
        if data["messages"] and data["messages"][-1]["status"] != "streaming":
            return data
        time.sleep(0.1)
    raise AssertionError("answer still streaming")
