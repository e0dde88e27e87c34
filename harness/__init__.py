"""What the tests and the benchmark share: a live gunicorn server on a free port."""
from .live_server import GUNICORN, ROOT, LiveServer, free_port

__all__ = ["GUNICORN", "ROOT", "LiveServer", "free_port"]
