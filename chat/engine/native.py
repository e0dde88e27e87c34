"""The decode step as one C++ call (``native.cpp``), compiled on this machine the first time.

Eager torch spends ~40 operator calls a layer of a decode step on vectors of a
few hundred numbers, ~3 µs each on this project's 2-core box: more than their
arithmetic, and about half of a one-row step. ``native.cpp`` runs every layer of
a decode step in one call: the four products on ATen's kernels (int4 or dense,
picked as ``quant.Linear`` picks), the norms, rotary positions, key/value writes,
attention and SwiGLU as plain loops (a one-row step 17 -> 9 ms here). The same
library samples the next tokens (``sample``: ~0.4 -> 0.1 ms a row with top-p).

It is built with the machine's C++ compiler (``$CXX``, else ``c++`` or ``g++``)
against the installed torch's headers, for the engine's CPU class (``cpu.py``:
``-march=native``, or that class's flags under ``CHAT_CPU_ISA``), at a low priority,
while the engine is idle after start-up (~15 s), into
``<model cache>/native/decode-<hash>.so``; the hash covers the source, torch's
version, the compiler, the CPU's flags and the class's, so a later start, or
another worker, loads it in milliseconds. Its loops keep bf16 in memory and
compute in float32, so they need no bf16 instruction: the step runs on every class. Before the engine
switches to it, its logits are checked against the eager step's on a fixed input.
Without a compiler, with ``CHAT_NATIVE=off``, or if the check fails, decode steps
stay on torch ops.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Generator
from typing import TYPE_CHECKING
from pathlib import Path

import torch

from ..concurrency import real_reap, real_sleep, real_spawn
from . import quant
from .cpu import Cpu, detect
from .kv import KVBuffer

if TYPE_CHECKING:
    from .decoder import Decoder

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


def load(path: Path) -> None:
    """Load the library into this process (once)."""
    if str(path) not in _loaded:
        torch.ops.load_library(str(path))
        _loaded.add(str(path))


# What the C++ step computes beyond the Llama core (architecture.FEATURES): a bias on any product.
COVERS = frozenset({"qkv_bias", "o_bias"})


class Step:
    """Every layer of ``decoder`` for a decode step, in one call: (rows, hidden) embeddings ->
    hidden states before the final norm. The weights are shared with the decoder, not copied."""

    def __init__(self, decoder: Decoder) -> None:
        missing = decoder.architecture.features - COVERS
        if missing:
            raise RuntimeError(f"{decoder.architecture.name} needs {', '.join(sorted(missing))}")
        norms, tensors, layout, biases, crossovers = [], [], [], [], []
        for layer in decoder.layers:
            norms += [layer.attn_norm, layer.mlp_norm]
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                layout.append(int(linear.dense is not None))
                tensors += [linear.dense] if linear.dense is not None else []
                segments = quant.parts(linear.quant) if linear.quant is not None else []
                layout.append(len(segments))
                for segment in segments:
                    if isinstance(segment, quant.Blocks):
                        layout += [-1, segment.id]
                    elif isinstance(segment, quant.Dense):
                        layout.append(0)
                        tensors.append(segment.weight)
                    else:
                        layout.append(len(segment.terms()))
                        tensors += [t for term in segment.terms() for t in (term.packed, term.scales)]
                biases.append(linear.bias if linear.bias is not None else torch.empty(0))
                crossovers.append(min(linear.crossover, 1 << 62) if linear.quant is not None else 0)
        s = decoder.shape
        self.id = torch.ops.chat_native.keep(norms, tensors, layout, biases, crossovers, s.heads, s.kv_heads,
                                             s.head_dim, s.eps)
        weakref.finalize(self, torch.ops.chat_native.forget, self.id)

    def __call__(self, embedded: torch.Tensor, kv: KVBuffer, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``embedded``: (rows x columns, hidden), a row's columns together; ``cos``/``sin``: (rows, columns,
        1, head dim), as ``Decoder._rope`` gives them. Keys and values go to columns ``kv.length`` on; each
        row attends from its first column (a lone row: from ``kv.start``), each column up to itself."""
        if kv.n == 1:
            starts = torch.tensor([kv.start])
        else:
            starts = torch.tensor(kv.row_starts(1)).add_(kv.start)
        dim = cos.shape[-1]
        return torch.ops.chat_native.decode(self.id, embedded, kv.keys, kv.values, starts, kv.length,
                                            cos.reshape(-1, dim), sin.reshape(-1, dim))


def sample(logits: torch.Tensor, params: list, u: torch.Tensor) -> list[int]:
    """``sampling.sample``'s draw for every row in one C++ call, given each sampled row's uniform
    number ``u``: the same filters and order; its sums run in another order than torch's, so a draw
    within rounding of the border between two tokens may take the neighbour."""
    return torch.ops.chat_native.sample(
        logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k or 0 for p in params]),
        torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p or 0.0 for p in params]), u).tolist()


def agrees(decoder: Decoder, step: Step) -> bool:
    """The C++ step's next-token logits match the eager step's on a fixed input (two rows, one
    left-padded): same top token per row, cosine above 0.999."""
    ids = torch.arange(3, 3 + 2 * 9).remainder(decoder.shape.vocab).view(2, 9)
    outputs = []
    for native in (None, step):
        kv = decoder.cache(2, 16)
        real = torch.ones(2, 9, dtype=kv.mask.dtype)
        real[1, :3] = 0  # the second row left-padded by 3
        kv.open(9, real)
        positions = (real.cumsum(1) - 1).clamp(min=0)
        decoder.forward(ids, kv, positions)
        kv.advance(9)
        kv.open(1)
        outputs.append(decoder.forward(ids[:, -1:], kv, positions[:, -1:] + 1, native=native or False))
    eager, mine = outputs
    cosine = torch.nn.functional.cosine_similarity(eager, mine, dim=-1)
    ok = bool((eager.argmax(-1) == mine.argmax(-1)).all()) and bool((cosine > 0.999).all())
    if not ok:
        log.warning("the C++ decode step disagrees with torch's (cosine %s): decode steps stay on torch ops",
                    [round(float(c), 5) for c in cosine])
    return ok


def columns_agree(decoder: Decoder, columns: int) -> bool:
    """A step of ``columns`` columns of one row (``Decoder.verify``) gives each column's logits bit for bit as
    that many single steps do, on a fixed input: drafted tokens are then checked exactly as the answer
    would have made them."""
    ids = torch.arange(5, 5 + 9 + columns).remainder(decoder.shape.vocab)[None]
    kv = decoder.cache(1, 16 + columns)
    kv.open(9)
    decoder.forward(ids[:, :9], kv, torch.arange(9)[None])
    kv.advance(9)
    kv.open(columns)
    wide = decoder.verify(ids[:, 9:], kv, torch.arange(9, 9 + columns)[None])
    single = []
    for j in range(columns):
        kv.open(1)
        single.append(decoder.forward(ids[:, 9 + j:10 + j], kv, torch.tensor([[9 + j]]))[0])
        kv.advance(1)
    ok = bool(torch.equal(wide, torch.stack(single)))
    if not ok:
        log.warning("a C++ step of %d columns differs from single steps here: no drafted tokens", columns)
    return ok


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


def use(decoder: Decoder) -> None:
    """Give ``decoder`` the C++ step (the library loaded) once it agrees with the eager step."""
    try:
        step = Step(decoder)
        ok = agrees(decoder, step)
    except RuntimeError as exc:  # a shape it does not cover (head size not a multiple of 16, ...)
        log.warning("the C++ decode step does not run this model (%s): decode steps stay on torch ops", exc)
        return
    if ok:
        decoder.native = step
        log.info("decode steps run in C++ (%s)", ", ".join(sorted(Path(p).name for p in _loaded)))


def attach(decoder: Decoder, cache_dir: str | Path, cpu: Cpu | None = None) -> Generator[None, None, None]:
    """Build (or find) the library, check it, and give ``decoder`` the C++ step; yields while building."""
    if (yield from library(cache_dir, cpu)):
        use(decoder)
