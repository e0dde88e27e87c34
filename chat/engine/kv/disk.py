"""Conversations' KV kept on disk (``CHAT_KV_DISK_MB``), so a conversation's next turn after a restart, or on
another worker, continues from its keys and values instead of prefilling its history again.

Each conversation's entry (its token ids, every layer's keys and values) is written when the prefix
cache takes it after an answer, by a writer thread of its own (never the engine's), to a temporary
file renamed into place: a reader never sees half a file. The folder is the model's own
(``<cache>/kv/<fingerprint>``: the model, its file's size and time, the KV's shape and type, the weights'
setting and the CPU class), so KV of another model or path is never read. An entry is read back (off the
engine thread, while the prompt is fitted) when a conversation's turn finds nothing held in memory; a
file that cannot be read as an entry is deleted and the prompt prefilled. The oldest files go first
beyond the byte budget; a deleted conversation's file goes with it.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...concurrency import Wakeup, start_real_thread

log = logging.getLogger(__name__)
MAGIC = b"CHAT-KV1"
PATIENCE_S = 5.0  # how long a write waits for the engine to be idle before it goes anyway


def fingerprint(*parts: object) -> str:
    """A folder name for KV computed by this model on this path."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def source_identity(path: Path | str | None) -> str:
    """A model file's path, size and modification time, or a folder's weight and config files' (what changes
    when the model is replaced); a hub id as it is."""
    if not path:
        return ""
    p = Path(path)
    files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.gguf", "config.json") for f in p.glob(pattern)) \
        if p.is_dir() else [p]
    parts = [str(p.resolve()) if p.exists() else str(path)]
    for f in files:
        try:
            stat = f.stat()
        except OSError:
            continue
        parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def for_model(folder: Path, budget: int, model: str, source: Path | str | None, dims: tuple, *setup: object,
              busy: Callable[[], bool] = lambda: False) -> DiskKV | None:
    """This model's entries on disk, in its own folder under ``folder``: keyed by ``model`` (its name), its
    ``source`` file or folder, the KV's ``dims`` (layers, heads, head dim, dtype, ...) and whatever else
    changes the KV (``setup``: the weights' setting, the CPU class); None (logged) where it cannot be kept."""
    layers, heads, dim, dtype = dims[:4]
    name = fingerprint(model, source_identity(source), layers, heads, dim, dtype, *setup)
    try:
        disk = DiskKV(Path(folder) / name, budget, (layers, heads, dim), dtype)
    except OSError as exc:
        log.warning("conversations' KV stays in memory only: %s", exc)
        return None
    disk.busy = busy
    return disk


Entry = tuple[list[int], list[torch.Tensor], list[torch.Tensor]]  # (ids, keys, values)


class DiskKV:
    """One model's conversation entries under ``folder``, at most ``budget`` bytes (the oldest out first)."""

    def __init__(self, folder: Path, budget: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        self.folder, self.budget = Path(folder), budget
        self.layers, self.heads, self.dim = shape
        self.dtype = dtype
        self.folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)  # as private as the database: keys and values tell the text
        self.leftovers = self._sweep()
        # real locks, not queue's: under gevent the writer is an OS thread that a patched queue would never wake
        self.pending: collections.deque = collections.deque()
        self.wake = Wakeup()
        self.writes = self.reads = 0
        self.dropped: set[str] = set()  # deleted conversations: an entry of theirs still waiting is not written
        self.busy: Callable[[], bool] = lambda: False  # the engine is running answers: writes wait (PATIENCE_S)
        self.idle = Wakeup()  # set by the engine when it has nothing to run
        start_real_thread(self._write_forever, name="kv-disk")

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.kv"

    def save(self, key: str, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
             salt: str | None = None) -> None:
        """Write an entry in the background (its tensors are never written in place afterwards); ``salt``:
        whose it is (PrefixCache), written with it and asked for again to read it."""
        self.dropped.discard(key)
        self.pending.append((key, list(ids), keys, values, salt))
        self.wake.set()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every entry saved so far is written (tests, shutdown)."""
        done = Wakeup()
        self.pending.append(done)
        self.wake.set()
        if not done.wait(timeout):
            log.warning("KV entries still being written after %.0f s", timeout)

    def load(self, key: str, salt: str | None = None) -> Entry | None:
        """A conversation's entry from disk, or None (none, one written for another salt, or one that cannot
        be read: deleted)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            found = self._read(path, key, salt)
            if found is None:
                return None
            ids, keys, values = found
        except Exception as exc:  # a torn, foreign or old file: prefill instead, and write it anew later
            log.warning("KV file %s unreadable (%s): deleted", path.name, exc)
            self.drop(key)
            return None
        self.reads += 1
        try:
            os.utime(path)  # recently used: the last to go
        except OSError:
            pass
        return ids, keys, values

    def _read(self, path: Path, key: str, salt: str | None) -> Entry | None:
        """The file's entry as views of its bytes (no torch operator: see ``_write``)."""
        with open(path, "rb") as f:  # read straight into a buffer the tensors can view: one copy of the file
            data = bytearray(os.fstat(f.fileno()).st_size)
            if f.readinto(data) != len(data):
                raise ValueError("a file that changed while read")
        if data[:len(MAGIC)] != MAGIC:
            raise ValueError("not a KV file")
        size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        header = json.loads(data[start:start + size])
        if header.get("salt") != salt:
            return None  # another identity's: kept for it, never read for this one
        ids = header["ids"]
        shape = (self.heads, len(ids), self.dim)
        if header.get("key") != key or header.get("dtype") != str(self.dtype) or header.get("shape") != [
                self.layers, *shape]:
            raise ValueError(f"an entry of {header.get('dtype')} {header.get('shape')}, not {self.dtype} "
                             f"{[self.layers, *shape]}")
        # each layer's columns: a windowed layer's entry holds its last ones only (KVBuffer.row)
        columns = header.get("columns", [len(ids)] * self.layers)
        if len(columns) != self.layers or not all(isinstance(c, int) and 0 < c <= len(ids) for c in columns):
            raise ValueError(f"columns {columns} for {len(ids)} ids")
        counts = [self.heads * c * self.dim for c in columns] * 2
        width = torch.empty(0, dtype=self.dtype).element_size()
        offset = start + size
        if len(data) != offset + sum(counts) * width:
            raise ValueError("a file cut short")
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=offset).view(self.dtype)
        parts, at = [], 0
        for c, count in zip(columns * 2, counts):
            parts.append(flat[at:at + count].view(1, self.heads, c, self.dim))
            at += count
        return ids, parts[:self.layers], parts[self.layers:]

    def drop(self, key: str) -> None:
        """A deleted conversation's file, now and if an entry of its is still being written."""
        self.dropped.add(key)
        self.path(key).unlink(missing_ok=True)

    def _write_forever(self) -> None:
        # (at normal priority: a thread that holds the GIL must not wait for the OS to run it)
        while True:
            self.wake.wait(60.0)
            while self.pending:
                item = self.pending.popleft()
                if isinstance(item, Wakeup):
                    item.set()
                    continue
                # The engine's gaps first (a person typing): wait, without waking, until the engine says it is
                # idle (``idle``), or PATIENCE_S: a thread that wakes while the engine decodes takes a core from
                # its OpenMP team.
                self.idle.wait(0)  # forget an idle moment that has passed
                if self.busy():
                    self.idle.wait(PATIENCE_S)
                try:
                    self._write(*item)
                    self._trim()
                except Exception:  # a full disk, a folder removed: the entry stays in memory only
                    log.exception("could not write a KV entry under %s", self.folder)

    def _write(self, key: str, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               salt: str | None = None) -> None:
        if key in self.dropped:
            return
        path = self.path(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        # Raw bytes behind a JSON header, and no torch operator on this thread: one that goes parallel starts an
        # OpenMP team of its own, and with more OpenMP threads than cores libgomp stops spinning at its
        # barriers, which halved the engine's decode speed (torch.save of a torch.cat here, measured).
        header = json.dumps({"key": key, "salt": salt, "ids": ids, "dtype": str(self.dtype),
                             "shape": [self.layers, self.heads, len(ids), self.dim],
                             "columns": [t.shape[2] for t in keys]}).encode()
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for t in [*keys, *values]:
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
        partial.replace(path)
        if key in self.dropped:  # deleted while it was written
            path.unlink(missing_ok=True)
            return
        self.writes += 1

    def _sweep(self) -> int:
        """Delete the partial files of writers that are gone (a crash, a SIGKILL); how many. A live
        worker's write in progress (its pid in the name) stays, unless it is an hour old."""
        gone, stale = 0, time.time() - 3600
        for f in self.folder.glob("*.tmp"):
            try:
                pid = int(f.name.split(".")[-3])
            except (ValueError, IndexError):
                pid = 0
            try:
                if not _alive(pid) or f.stat().st_mtime < stale:
                    f.unlink(missing_ok=True)
                    gone += 1
            except OSError:
                continue
        if gone:
            log.info("deleted %d partial KV files a stopped process left under %s", gone, self.folder)
        return gone

    def _trim(self) -> None:
        self._sweep()
        files = []
        for f in [*self.folder.glob("*.kv"), *self.folder.glob("*.tmp")]:  # writes in progress count too
            try:
                stat = f.stat()
            except OSError:  # another worker trimmed it
                continue
            files.append((stat.st_mtime_ns, stat.st_size, f))
        total = sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if total <= self.budget:
                break
            if f.suffix == ".kv":
                f.unlink(missing_ok=True)
                total -= size


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
