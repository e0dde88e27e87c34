"""gunicorn settings: the gevent worker, one model copy per worker, streams never killed."""
import sys

from chat.config import Settings
from chat.errors import ConfigError

try:
    _settings = Settings.from_env()
except ConfigError as exc:
    sys.exit(f"configuration error: {exc}")

bind = _settings.bind
worker_class = "gevent"
workers = _settings.workers  # each worker loads its own model copy
worker_connections = 1000
# The model never runs on the event loop, so the heartbeat stays fresh during long answers;
# this only catches a truly wedged worker.
timeout = 120
graceful_timeout = int(_settings.graceful_timeout_s)
keepalive = 75
# Load the model after the fork, inside each worker (torch state does not survive fork well).
preload_app = False
accesslog = "-"
errorlog = "-"
loglevel = _settings.log_level
# Headers such as X-Forwarded-Proto are honoured by the app itself, only from trusted hops.
forwarded_allow_ips = "*" if _settings.trusted_proxies else "127.0.0.1"


def worker_int(worker):
    """SIGINT/SIGQUIT in a worker: end streams cleanly like SIGTERM."""
    _shutdown(worker)


def worker_exit(server, worker):
    """Last chance to end the engine's work cleanly."""
    _shutdown(worker)


def _shutdown(worker):
    app = getattr(worker.wsgi, "extensions", {}) if hasattr(worker, "wsgi") else {}
    state = app.get("chat") if isinstance(app, dict) else None
    if state is not None:
        state.engine.shutdown("shutdown")
