"""gunicorn settings: the gevent worker, one model copy per worker (local backend), streams never killed."""
import logging
import os
import signal
import sys

from gunicorn.glogging import Logger


def _share_metrics() -> None:
    """With several workers, /metrics must count all of them: prometheus_client's multiprocess
    mode, whose folder has to be in the environment before chat (and prometheus_client) is imported."""
    try:
        workers = int(os.environ.get("CHAT_WORKERS") or 1)
    except ValueError:
        return  # Settings.from_env reports it below
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        import tempfile
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _METRICS_DIR[0] = tempfile.mkdtemp(prefix="chat-metrics-")


_METRICS_DIR = [None]  # the folder made here, removed on exit

_share_metrics()

from chat.config import Settings  # noqa: E402  (after the metrics folder is set)
from chat.errors import ConfigError  # noqa: E402

try:
    _settings = Settings.from_env()
except ConfigError as exc:
    sys.exit(f"configuration error: {exc}")

bind = _settings.bind
# gunicorn's gevent worker, with a deadline for request headers and a per-address connection cap
# (chat/web/gunicorn_worker.py).
worker_class = "chat.web.gunicorn_worker.Worker"
workers = _settings.workers  # with the local backend each loads its own model copy (see on_starting)
worker_connections = _settings.worker_connections
# The model never runs on the event loop, so the heartbeat stays fresh during long answers;
# this only catches a truly wedged worker.
timeout = 120
graceful_timeout = int(_settings.graceful_timeout_s)
keepalive = 75
# Load the model after the fork, inside each worker (torch state does not survive fork well).
preload_app = False
accesslog = "-"
# gunicorn's control socket (gunicornc) defaults to one path per user, which every instance would
# share and the first to stop would delete: none, or the one this instance names.
control_socket_disable = not _settings.control_socket
if _settings.control_socket:
    control_socket = _settings.control_socket


class RedactingLogger(Logger):
    """gunicorn's logger, with the API key cut out of access-log lines (``?token=`` however encoded,
    auth headers) and the search words too unless CHAT_LOG_CONTENT (chat/web/access_log.py)."""

    SECRET_HEADERS = ("{authorization}i", "{sec-websocket-protocol}i", "{cookie}i")
    QUERIES = ("q", "{query_string}e")
    URIS = ("{raw_uri}e", "f", "{referer}i")

    def atoms(self, resp, req, environ, request_time):
        from chat.web import access_log

        atoms = super().atoms(resp, req, environ, request_time)
        keep = _settings.log_content
        path = environ.get("PATH_INFO", "")
        for name, value in atoms.items():
            if not isinstance(value, str):
                continue
            if name in self.SECRET_HEADERS:
                atoms[name] = "[redacted]"
            elif name == "r":
                atoms[name] = access_log.redact_request_line(value, keep)
            elif name in self.QUERIES:
                atoms[name] = access_log.redact_query(value, path, keep)
            elif name in self.URIS or "?" in value:
                atoms[name] = access_log.redact_uri(value, keep)
        return atoms


logger_class = RedactingLogger
errorlog = "-"
loglevel = _settings.log_level
# X-Forwarded-* headers are judged by the app itself (CHAT_TRUSTED_PROXIES), never by gunicorn.
forwarded_allow_ips = ""


def on_starting(server):
    """Say once, in the master, what several workers imply (model copies, per-worker state)."""
    from chat.topology import warnings

    for line in warnings(_settings):
        server.log.warning(line)
    import resource
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if files != resource.RLIM_INFINITY and files < worker_connections + 64:
        server.log.warning("the open-files limit (%d) is below CHAT_WORKER_CONNECTIONS (%d) plus the files a "
                           "worker keeps: raise it (ulimit -n, LimitNOFILE=) or lower the setting",
                           files, worker_connections)


def post_worker_init(worker):
    """On SIGTERM, finish answers within the graceful timeout and store the rest as partial."""
    import gevent

    from chat import app_state

    state = app_state(worker.wsgi)
    # Keep a margin inside gunicorn's own graceful timeout for the final shutdown frames.
    budget = max(worker.cfg.graceful_timeout * 0.5, worker.cfg.graceful_timeout - 3)

    def on_term():
        worker.alive = False  # gunicorn stops accepting connections
        state.shutdown(budget)

    gevent.signal_handler(signal.SIGTERM, on_term)

    def watch_parent():
        # The gevent worker does not notice a dead master by itself; never outlive it.
        while worker.alive:
            if os.getppid() != worker.ppid:
                worker.log.warning("master is gone; shutting down worker %s", worker.pid)
                on_term()
                return
            gevent.sleep(1.0)

    gevent.spawn(watch_parent)


def on_exit(server):
    """Remove the metrics folder this master made."""
    if _METRICS_DIR[0]:
        import shutil
        shutil.rmtree(_METRICS_DIR[0], ignore_errors=True)


def child_exit(server, worker):
    """A worker is gone: its live gauges (connections, running answers) no longer count."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid)


def worker_exit(server, worker):
    """The server let go of every connection: close the app (engine, store, shared state), then leave at once.

    Interpreter shutdown can hang in the gevent hub when the master died first
    (the worker logs "exiting" and lingers); everything worth keeping is already
    committed to SQLite, so skip the finalizers.
    """
    app = getattr(worker, "wsgi", None)
    if app is not None and "chat" in getattr(app, "extensions", {}):  # None if the app failed to load
        from chat import app_state
        app_state(app).close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
