"""Attached documents (PDF, DOCX, HTML, CSV) read to text on the server: which kind a file is (images
refused, by name and by content), and the worker process that reads it within bounds (its bytes,
pages and characters, memory, CPU time and wall time), a few at once per worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from .errors import ProtocolError

KINDS = {".pdf": "pdf", ".docx": "docx", ".html": "html", ".htm": "html", ".csv": "csv"}
IMAGES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".heic", ".svg", ".tif", ".tiff", ".avif")
IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")
ACCEPTED = "text files (code, Markdown, JSON…), PDF, DOCX, HTML and CSV"
MAX_PAGES = 300  # of a PDF, read at most
TIMEOUT_S = 20.0  # a document's reading, wall time
MEMORY_BYTES = 1 << 30  # the worker's address space
AT_ONCE = 2  # documents read at once by one server worker; more are refused with `overloaded`
_ROOT = str(Path(__file__).resolve().parent.parent)
_running = threading.BoundedSemaphore(AT_ONCE)


def kind_of(name: str, data: bytes) -> str:
    """The document kind of a file named ``name`` ("pdf", "docx", "html", "csv"); bad_message naming
    what is accepted for an image or any other file, and for a file whose content is not its kind."""
    suffix = os.path.splitext(name.lower())[1]
    if suffix in IMAGES or data.startswith(IMAGE_MAGIC) or data[8:12] == b"WEBP":
        raise ProtocolError("bad_message", f"“{name}” is an image: images cannot be read here (this model reads "
                                           f"text only). Attach {ACCEPTED}.")
    kind = KINDS.get(suffix)
    if kind is None:
        raise ProtocolError("bad_message", f"“{name}” is not a document this server reads: attach {ACCEPTED}.")
    if (kind == "pdf" and not data.startswith(b"%PDF-")) or (kind == "docx" and not data.startswith(b"PK\x03\x04")):
        raise ProtocolError("bad_message", f"“{name}” is not a {kind.upper()} file inside (damaged, or renamed).")
    return kind


def _limit() -> None:  # in the worker, before it runs: memory and CPU time
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (int(TIMEOUT_S) + 1, int(TIMEOUT_S) + 1))


def extract(name: str, data: bytes, max_chars: int) -> dict:
    """{"text", "pages" (a PDF's, else None), "truncated"} of document ``name``: read by a process of its
    own (chat/document_worker.py), so a bad file costs that process alone; the caller's greenlet waits."""
    kind = kind_of(name, data)
    if not _running.acquire(blocking=False):
        raise ProtocolError("overloaded", "documents are being read for others right now; try again in a moment")
    try:
        done = subprocess.run([sys.executable, "-m", "chat.document_worker", kind, str(MAX_PAGES), str(max_chars)],
                              input=data, capture_output=True, timeout=TIMEOUT_S, cwd=_ROOT, preexec_fn=_limit,
                              env={**os.environ, "PYTHONPATH": _ROOT})
    except subprocess.TimeoutExpired:
        raise ProtocolError("too_large", f"“{name}” took longer than {TIMEOUT_S:.0f} s to read; "
                                         "attach a smaller part of it") from None
    finally:
        _running.release()
    try:
        result = json.loads(done.stdout)
    except ValueError:  # killed (memory, CPU time) or crashed
        raise ProtocolError("too_large", f"“{name}” could not be read within this server's limits") from None
    if "error" in result:
        raise ProtocolError("bad_message", f"“{name}” could not be read: {result['error']}")
    return result
