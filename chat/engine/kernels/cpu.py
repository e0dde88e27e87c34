"""The CPU the engine runs on: its instruction-set class, read once from ``/proc/cpuinfo``, or the
lower class ``CHAT_CPU_ISA`` asks for (so an AVX-512 machine can test and measure the AVX2 path).

Classes, best first:

- ``avx512_bf16``: AVX-512 with native bf16 (``avx512_bf16`` or ``amx_bf16``): dense bf16 products are
  fast at any number of rows, so the int4 weights get dense bf16 copies for long prefills;
- ``avx512``: AVX-512 without bf16 (often with VNNI);
- ``avx2``: AVX2 with FMA (most cloud VMs, desktops and mini PCs);
- ``generic``: anything else (baseline x86-64 or another architecture).

On every class the decode step's products take torch's int4 kernel with bf16 activations (it is
fast with bf16 inputs even where bf16 arithmetic is emulated; with float32 inputs it takes a
reference path 7-25x slower), and the C++ step's loops keep bf16 in memory and compute in float32,
which needs no bf16 instruction. What differs is the dense products: see ``quant.POLICY``.

No torch here: ``limit`` must run before torch is imported (its kernels read the environment once).
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache

log = logging.getLogger(__name__)

CLASSES = ("generic", "avx2", "avx512", "avx512_bf16")  # worst first: a class covers those before it
# What torch's own kernels are told for a class below the machine's (read once, at torch's first use):
# ATen's vectorized kernels, oneDNN (bf16/int8 matmuls) and MKL (float32 matmuls).
_TORCH_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
# The C++ step's compiler flags for a class below the machine's (its own class: -march=native).
_CXX_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "generic": [],
}


@dataclass(frozen=True)
class Cpu:
    """The class the engine uses (``isa``), the machine's own (``machine``) and its feature flags."""

    isa: str
    machine: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        return self.isa == "avx512_bf16"

    @property
    def limited(self) -> bool:
        """Running a lower class than the machine's (``CHAT_CPU_ISA``)."""
        return self.isa != self.machine

    def cxx_flags(self) -> list[str]:
        """How the C++ step is compiled for this class."""
        if not self.limited:
            return ["-march=native"]
        extra = ["-mavx512vnni"] if self.isa == "avx512" and "avx512_vnni" in self.flags else []
        return [*_CXX_FLAGS[self.isa], *extra, "-mtune=native"]

    def describe(self) -> str:
        return self.isa if not self.limited else f"{self.isa} (of {self.machine}, CHAT_CPU_ISA)"


def _flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def classify(flags: frozenset[str]) -> str:
    """The best class a CPU with these feature flags belongs to."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    if "avx512f" in flags and ("avx512_bf16" in flags or "amx_bf16" in flags):
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


@cache
def detect(requested: str = "auto") -> Cpu:
    """The machine's class, or ``requested`` where that is lower (``auto``: the machine's)."""
    flags = _flags()
    machine = classify(flags)
    isa = machine
    if requested != "auto":
        if requested not in CLASSES:
            raise ValueError(f"unknown CPU class {requested!r}")
        if CLASSES.index(requested) < CLASSES.index(machine):
            isa = requested
        elif requested != machine:
            log.warning("CHAT_CPU_ISA=%s: this CPU is %s; using %s", requested, machine, machine)
    return Cpu(isa, machine, flags)


def limit(requested: str) -> Cpu:
    """Detect the class and, for a class below the machine's, tell torch's kernels so too, through the
    environment variables they read once. Call before torch is imported; after, torch's kernels keep the
    machine's class (logged) and only the engine's own choices follow ``requested``."""
    cpu = detect(requested)
    if cpu.limited:
        env = _TORCH_ENV[cpu.isa]
        if "torch" in sys.modules:
            log.warning("CHAT_CPU_ISA=%s set after torch was imported: torch's kernels keep %s (set %s before "
                        "the process starts)", requested, cpu.machine, ", ".join(f"{k}={v}" for k, v in env.items()))
        for name, value in env.items():
            os.environ.setdefault(name, value)
    return cpu
