"""Fixtures: the app in-process with a fake engine (fast), live gunicorn + gevent servers with a
tiny real model (end to end), WebSocket clients, real Redis, PostgreSQL and Chromium; and the test tiers.

Helpers that test modules share are in helpers.py (import them from there). A test is in the slow
tier (marker ``slow``: ``make test-fast`` leaves it out) when it uses a fixture in SLOW_FIXTURES, a
parameter in SLOW_PARAMS, or lives in a module in SLOW_MODULES; anything else is fast by default.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
from fakes import AppServer, FakeEngine
from helpers import (  # noqa: F401  (re-exported: modules written before helpers.py import them from here)
    GUNICORN,
    ROOT,
    WS,
    LiveServer,
    conv_of,
    conversation,
    cookie_for,
    free_port,
    http_get,
    in_threads,
    start_of,
    text_of,
    wait_settled,
)
from pg import BACKENDS, PostgresServer, database
from redis_server import RedisServer
from tinymodel import tiny_model_dir

# What puts a test in the slow tier: a real gunicorn (and so the tiny model's process start), Chromium,
# nginx, Redis, PostgreSQL, the real model, or a soak or stress run.
SLOW_FIXTURES = {"server_factory", "gunicorn_server", "browser", "postgres", "redis_server"}
SLOW_PARAMS = {"postgresql", "redis"}  # parametrized twins that run on a real service
# test_engine_race: a storm of threads at a 1 µs switch interval, 6 s on a quiet box and over 150 s on a busy one.
SLOW_MODULES = {"test_nginx", "test_nginx_scaleout", "test_soak_abuse", "test_smoke_real_model", "test_engine_race"}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the slow tier (see the module docstring)."""
    for item in items:
        params = getattr(item, "callspec", None)
        values = {v for v in params.params.values() if isinstance(v, str)} if params else set()
        if (SLOW_FIXTURES & set(item.fixturenames) or SLOW_PARAMS & values
                or item.module.__name__ in SLOW_MODULES or item.get_closest_marker("real_model")):
            item.add_marker(pytest.mark.slow)


def live_env(workdir: Path) -> dict:
    """A live test server's settings: its own data folder, no limits in the way, one torch thread."""
    return {"CHAT_DATA_DIR": str(workdir / "data"), "CHAT_DTYPE": "float32", "CHAT_RATE_LIMIT_PER_MIN": "0",
            # every test client comes from 127.0.0.1: per-address limits only where a test sets them
            "CHAT_RATE_LIMIT_PER_IP_PER_MIN": "0", "CHAT_MAX_ACTIVE_PER_IP": "0",
            # one torch thread: on a shared 2-core box a 2-thread team stalls on every op
            "CHAT_THREADS": "1",
            "CHAT_GRACEFUL_TIMEOUT_S": "5", "CHAT_CACHE_DIR": str(ROOT / "data" / "model-cache"),
            "CHAT_KV_DISK_MB": "64",  # conversations' KV on disk in the shared cache: a little
            # no model-written titles: one landing in the background would change a conversation a test compares
            # before and after (tests/test_browser_titles.py asks for them)
            "CHAT_TITLES": "off"}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A small random Qwen2 model folder, built once."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory, tiny_model):
    """Start real gunicorn servers with extra env; all are stopped at the end of the session."""
    servers = []

    def start(name: str = "srv", wait: bool = True, **env) -> LiveServer:
        """``wait``: until /readyz says ready (else only until the process is spawned)."""
        workdir = tmp_path_factory.mktemp(name)
        srv = LiveServer(workdir, {**live_env(workdir), "CHAT_MODEL": str(tiny_model), **env}, start=False)
        servers.append(srv)
        srv.start(wait=wait)
        return srv

    yield start
    for srv in servers:
        srv.stop(signal.SIGKILL if srv.proc and srv.proc.poll() is None else signal.SIGTERM, timeout=10)


@pytest.fixture(scope="session")
def gunicorn_server(server_factory) -> LiveServer:
    """The shared real server: tiny model, long answers allowed."""
    # Answers count per client across its connections: room for eight parallel streams of one cookie.
    # Chats keep their first words as titles here (what most page tests read); the model's titles
    # are tested on servers of their own (test_titles.py, test_browser_titles.py).
    return server_factory("shared", CHAT_MAX_NEW_TOKENS=4096, CHAT_CONTEXT_TOKENS=8192,
                          CHAT_RESUME_GRACE_S=3, CHAT_MAX_ACTIVE_PER_CONNECTION=8, CHAT_TITLES="off")


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


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server for the module (see redis_server.py); fails when it is not installed."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def store(db_path):
    """A Store on a fresh database of each backend."""
    from chat.store import Store
    s = Store(db_path)
    yield s
    s.close()


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
                    "max_active_per_connection": 8, "data_dir": str(data), "titles": False, **settings}
        engine = engine or FakeEngine(answer_words=100_000, delay=0.001, seeded=True)
        settings = Settings(**settings)
        store = None if settings.engine_only else Store(settings.db_path)  # an engine opens none
        srv = AppServer(create_app(settings, engine=engine, store=store))
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.state.engine.shutdown()
    in_threads(lambda i: servers[i].close(), len(servers))  # each waits up to 0.5 s for its serve loop


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


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (Debian's build, never a downloaded one)."""
    from playwright import sync_api
    # Never skipped: a missing browser is a broken test machine (make test installs Debian's chromium).
    assert Path(CHROMIUM).exists(), f"needs Debian's chromium at {CHROMIUM}: apt-get install chromium"
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def chat(browser, server):
    """Open chat pages with ``chat(**options)``; each gets a fresh context, closed afterwards."""
    from helpers import Chat
    opened = []

    def open_chat(**options) -> Chat:
        c = Chat(browser, server.url, **options)
        opened.append(c)
        return c.open()

    yield open_chat
    for c in opened:
        c.close()
    for c in opened:
        assert not c.errors, c.errors
