"""The CPU classes (chat/engine/kernels/cpu.py): how a CPU is classed, what CHAT_CPU_ISA limits, and the engine on
the AVX2 class on whatever machine runs the tests (torch's kernels told so before torch is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT
from tinygguf import tiny_gguf

from chat.engine.kernels import cpu, quant

AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags, isa", [
    (set(), "generic"),
    ({"sse4_2", "avx"}, "generic"),
    (AVX2, "avx2"),
    (AVX512, "avx512"),
    (AVX512 | {"avx512_vnni"}, "avx512"),
    (AVX512 | {"avx512_bf16"}, "avx512_bf16"),
    (AVX512 | {"amx_bf16", "avx512_bf16"}, "avx512_bf16"),
])
def test_a_cpu_is_classed_by_its_flags(flags, isa, monkeypatch):
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.classify(frozenset(flags)) == isa


def test_chat_cpu_isa_only_lowers_the_class(monkeypatch):
    monkeypatch.setattr(cpu, "_flags", lambda: frozenset(AVX2))
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    cpu.detect.cache_clear()
    try:
        assert cpu.detect("auto") == cpu.Cpu("avx2", "avx2", frozenset(AVX2))
        assert cpu.detect("avx512_bf16").isa == "avx2"  # above the machine: ignored
        lowered = cpu.detect("generic")
        assert lowered.isa == "generic" and lowered.limited
        assert "-march=native" not in lowered.cxx_flags() and "-mavx2" not in lowered.cxx_flags()
        assert cpu.detect("auto").cxx_flags() == ["-march=native"]
    finally:
        cpu.detect.cache_clear()


def test_each_class_has_its_compiler_flags_and_a_policy():
    flags = frozenset(AVX512 | {"avx512_vnni", "avx512_bf16"})
    assert cpu.Cpu("avx2", "avx512_bf16", flags).cxx_flags()[:2] == ["-mavx2", "-mfma"]
    assert "-mavx512f" not in cpu.Cpu("avx2", "avx512_bf16", flags).cxx_flags()
    assert {"-mavx512f", "-mavx512vnni"} <= set(cpu.Cpu("avx512", "avx512_bf16", flags).cxx_flags())
    assert set(quant.POLICY) == set(cpu.CLASSES)
    assert [quant.dense_copies(c) for c in cpu.CLASSES] == [False, False, False, True]
    assert [quant.quantized(c) for c in cpu.CLASSES] == [False, True, True, True]


ENGINE_ON_AVX2 = """
import json, sys, time
from chat.config import Settings
from chat.engine import GenParams, Delta, make_engine
settings = Settings.from_env({}, model=sys.argv[1], data_dir=sys.argv[2], cpu_isa=sys.argv[3], threads=1)
engine = make_engine(settings)
deadline = time.monotonic() + 240
while not engine.ready or engine.chores is not None:
    assert engine.error is None and time.monotonic() < deadline, engine.error
    time.sleep(0.05)
import os, torch
def text(gen):
    return "".join(e.text for e in gen if isinstance(e, Delta))
greedy = text(engine.submit([{"role": "user", "content": "hello"}], GenParams(temperature=0, max_new_tokens=12)))
seeded = GenParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=24)
alone = text(engine.submit([{"role": "user", "content": "tell me"}], seeded))
others = [engine.submit([{"role": "user", "content": f"other {i}"}], GenParams(temperature=1.0, max_new_tokens=40))
          for i in range(3)]
batched = text(engine.submit([{"role": "user", "content": "tell me"}], seeded))
for gen in others:
    text(gen)
facts = engine.describe()
print(json.dumps({"weights": facts["weights"], "cpu": facts["cpu"], "decode": facts["decode"],
                  "capability": torch.backends.cpu.get_cpu_capability(), "text": greedy,
                  "seeded": [alone, batched],
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}), flush=True)
engine.shutdown()
os._exit(0)  # not through the interpreter's exit while the engine's thread winds down
"""


BELOW = [c for c in ("avx2", "avx512") if cpu.CLASSES.index(c) < cpu.CLASSES.index(cpu.detect().machine)]


@pytest.mark.slow
@pytest.mark.skipif(not BELOW, reason="no class below this CPU's to run")
@pytest.mark.parametrize("isa", BELOW or ["avx2"])
def test_the_engine_runs_a_lower_class_on_a_better_cpu(tmp_path, isa):
    """AVX2: the block products with 8-bit activations by maddubs (no VNNI in that class) and the C++ step built
    with AVX2 flags; AVX-512 without bf16: VNNI where the machine has it, bf16 converted by hand. Torch's kernels
    told the class; a seeded answer the same alone and in a batch."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", ENGINE_ON_AVX2, str(tiny_gguf(hidden=256, qtype="mix", arch="qwen2")),
                          str(tmp_path), isa], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["weights"] == "blocks" and facts["cpu"] == isa and facts["decode"] == "native", facts
    assert facts["capability"] == isa.upper() and facts["onednn"] == cpu._TORCH_ENV[isa]["ONEDNN_MAX_CPU_ISA"]
    assert facts["text"]
    alone, batched = facts["seeded"]
    assert alone and alone == batched  # a seeded answer does not depend on the batch on this class either
    assert list((tmp_path / "model-cache" / "native").glob("decode-*.so"))
