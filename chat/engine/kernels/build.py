"""The C++ library (``native.cpp``, ``blocks.cpp``): compiled on this machine the first time, kept, loaded.

It is built with the machine's C++ compiler (``$CXX``, else ``c++`` or ``g++``) against the installed
torch's headers, for the engine's CPU class (``cpu.py``: ``-march=native``, or that class's flags under
``CHAT_CPU_ISA``), at a low priority, while the engine is idle after start-up (~15 s), into
``<model cache>/native/decode-<hash>.so``; the hash covers the sources, torch's version, the compiler, the
CPU's flags and the class's, so a later start, or another worker, loads it in milliseconds. Without a
compiler, or where the build fails, the caller goes on without it (logged why).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import torch

from ...concurrency import real_reap, real_sleep, real_spawn
from .cpu import Cpu, detect

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.cpp")
SOURCES = (SOURCE, SOURCE.with_name("blocks.cpp"), SOURCE.with_name("blocks.h"))  # compiled into one library
_loaded: set[str] = set()


def compiler() -> str | None:
    """The C++ compiler to build with, or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def library_path(cache_dir: str | Path, cxx: str, version: str, cpu: Cpu) -> Path:
    """Where the build for this source, torch, compiler (``version``: what it says of itself), CPU and
    CPU class is kept."""
    sources = [s.read_text() for s in SOURCES]
    key = hashlib.sha256("\0".join([*sources, torch.__version__, cxx, version, " ".join(sorted(cpu.flags)),
                                    *cpu.cxx_flags()]).encode()).hexdigest()[:16]
    return Path(cache_dir) / "native" / f"decode-{key}.so"


def _run(args: list[str], scratch: Path, poll_s: float) -> Generator[None, None, tuple[int, str]]:
    """Run ``args`` in the background, yielding while it runs; returns (exit status, its output). A
    shell writes the status to a file: under gevent the worker's event loop may reap the child
    before anyone can wait for it."""
    status = scratch / f"run-{time.monotonic_ns()}"
    script = '"$@" >"$0.out" 2>&1; echo $? > "$0.tmp" && mv "$0.tmp" "$0"'
    pid = real_spawn(["/bin/sh", "-c", script, str(status), *args])
    while not status.exists():
        real_sleep(poll_s)
        yield
    real_reap(pid)
    return int(status.read_text().strip() or 1), Path(f"{status}.out").read_text(errors="replace")


def command(cxx: str, target: Path, cpu: Cpu) -> list[str]:
    """The compiler's command line: the library against the running torch, for this CPU class."""
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    # -fopenmp: at::parallel_for on torch's own OpenMP threads (the libgomp torch loaded serves the library)
    return [cxx, "-O3", *cpu.cxx_flags(), "-fno-trapping-math", "-std=c++20", "-shared", "-fPIC", "-w", "-fopenmp",
            f"-I{torch_dir / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(str(s) for s in SOURCES if s.suffix == ".cpp"), "-o", str(target), f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-lc10", "-ltorch_cpu"]


def build(cache_dir: str | Path, cpu: Cpu | None = None, poll_s: float = 0.05,
          compile: bool = True) -> Generator[None, None, Path | None]:
    """Compile the library unless it is already kept; a generator that yields while the compiler
    runs (so the engine can serve between polls) and returns its path, or None (logged why; quietly when
    not ``compile`` and none is kept)."""
    cpu = cpu or detect()
    cxx = compiler()
    if cxx is None:
        if not compile:
            return None
        log.info("no C++ compiler (c++, g++ or $CXX): decode steps stay on torch ops (install g++ for a "
                 "step about twice as fast)")
        return None
    folder = Path(cache_dir) / "native"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=folder) as name:
        scratch = Path(name)
        _, version = yield from _run([cxx, "--version"], scratch, poll_s)
        target = library_path(cache_dir, cxx, version, cpu)
        if target.exists():
            return target
        if not compile:
            return None
        partial = scratch / "decode.so"
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # serving goes first
        code, output = yield from _run([*nice, *command(cxx, partial, cpu)], scratch, poll_s)
        if code != 0 or not partial.exists():
            log.warning("could not build the C++ decode step (%s exited %d): %s", Path(cxx).name, code,
                        output[-2000:])
            return None
        partial.replace(target)  # atomic: a worker starting meanwhile never loads half a file
    log.info("built the C++ decode step in %.1f s: %s", time.monotonic() - started, target)
    return target


def loaded_paths() -> list[str]:
    """The libraries loaded into this process."""
    return sorted(_loaded)


def load(path: Path) -> None:
    """Load the library into this process (once)."""
    if str(path) not in _loaded:
        torch.ops.load_library(str(path))
        _loaded.add(str(path))


# What the C++ step computes beyond the Llama core (architecture.FEATURES): a bias on any product.
def library(cache_dir: str | Path, cpu: Cpu | None = None, compile: bool = True) -> Generator[None, None, bool]:
    """Build (or find) the library and load it; yields while building. False (logged why) when it cannot
    be; with ``compile`` False, unless a build is already kept."""
    try:
        path = yield from build(cache_dir, cpu, compile=compile)
    except OSError as exc:  # the cache folder cannot be written, no /bin/sh, ...
        log.warning("could not build the C++ decode step under %s: %s; decode steps stay on torch ops",
                    cache_dir, exc)
        return False
    if path is None:
        return False
    try:
        load(path)
    except OSError as exc:
        log.warning("could not load the C++ decode step from %s (removed, built again next start): %s", path, exc)
        path.unlink(missing_ok=True)
        return False
    return True


def kept(cache_dir: str | Path, cpu: Cpu | None = None) -> bool:
    """Load the library now if a build for this source, compiler and CPU is kept (no compiling): whether
    the block products (``quant.Blocks``) can be made from the start."""
    steps = library(cache_dir, cpu, compile=False)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return bool(done.value)


