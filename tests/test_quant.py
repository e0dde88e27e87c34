"""GGUF weights on the int4 kernel: the block mapping, the own decoder against transformers, the
start-up self-check and its fallback, and the engine on a quantized model."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from tinygguf import tiny_gguf

from chat.config import Settings
from chat.engine import Delta, GenParams
from chat.engine.core.local import LocalEngine
from chat.engine.kernels import cpu, crossover, gguf, quant
from chat.engine.model import loader, weights

torch = pytest.importorskip("torch")
# The int4 kernel runs on every x86 class with AVX2 (cpu.py); only a "generic" CPU keeps dense weights.
int4_cpu = pytest.mark.skipif(not quant.quantized(cpu.detect().isa), reason="the int4 path needs an x86 CPU with AVX2")


def on_thread(fn):
    """Run ``fn`` on a fresh thread (the engine never runs torch on the main thread) and return its result."""
    out: list = []

    def run():
        try:
            with torch.inference_mode():
                out.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def synthetic(kind: str, rows: int = 48, cols: int = 96, seed: int = 0) -> tuple[gguf.Tensor, np.ndarray]:
    """(a tensor of ``kind`` quantized by gguf-py from random floats, gguf-py's own dequantization)."""
    from gguf import GGMLQuantizationType, quants
    qt = GGMLQuantizationType[kind]
    data = np.random.default_rng(seed).normal(0, 1, (rows, cols)).astype(np.float32)
    blocks = quants.quantize(data, qt)
    tensor = gguf.Tensor("w", (rows, cols), int(qt), blocks.reshape(-1))
    return tensor, quants.dequantize(blocks, qt).reshape(rows, cols)


QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these; K-quants: random blocks
ALL_TYPES = [*QUANTIZABLE, "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "F16", "BF16", "F32"]


def blocks_of(kind: str, rows: int = 48, cols: int = 256, seed: int = 0) -> tuple[gguf.Tensor, np.ndarray]:
    """(a tensor of ``kind``: gguf-py's quantization of random floats, or for types gguf-py cannot
    quantize, random blocks with small finite scales; gguf-py's own dequantization of it)."""
    from gguf import GGMLQuantizationType, quants
    qt = GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    data = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    if kind in QUANTIZABLE or kind in ("F16", "BF16", "F32"):
        stored = quants.quantize(data, qt)
    else:
        per, size = quants.GGML_QUANT_SIZES[qt]
        stored = rng.integers(0, 256, (rows, cols // per * size), dtype=np.uint8)
        view = stored.reshape(rows, cols // per, size)
        halves = (np.abs(rng.normal(0, 0.01, (rows, cols // per, 2)))).astype(np.float16).view(np.uint8)
        for at in {"Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}.get(kind, [0, 2]):  # where d (and dmin) are
            view[:, :, at:at + 2] = halves[:, :, :2] if at in (0, 80, 108, 208) else halves[:, :, 2:]
    tensor = gguf.Tensor("w", (rows, cols), int(qt), np.ascontiguousarray(stored).view(np.uint8).reshape(-1))
    return tensor, quants.dequantize(stored, qt).reshape(rows, cols)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_dequantization_is_gguf_pys_bit_for_bit(kind):
    tensor, reference = blocks_of(kind)
    assert np.isfinite(reference).all()
    assert np.array_equal(gguf.dequantize(tensor).numpy(), reference)


@pytest.mark.parametrize("kind", [gguf.type_name(k) for k in gguf.AFFINE])
def test_affine_parts_are_the_weights_bit_for_bit(kind):
    tensor, reference = blocks_of(kind)
    q, s, z = gguf.affine(tensor)
    assert q.dtype == torch.uint8 and int(q.max()) < 1 << gguf.BITS[tensor.kind]
    rebuilt = q.reshape(48, -1, 32).float() * s[..., None] + z[..., None]
    assert np.array_equal(rebuilt.reshape(48, 256).numpy(), reference)


@int4_cpu
@pytest.mark.parametrize("kind", [gguf.type_name(k) for k in gguf.AFFINE])
def test_the_int4_kernel_multiplies_by_the_blocks_weights(kind):
    tensor, reference = blocks_of(kind)

    def product():
        matrix = quant.from_affine(*gguf.affine(tensor), gguf.BITS[tensor.kind])
        assert isinstance(matrix, quant.Int4 if gguf.BITS[tensor.kind] == 4 else quant.Sum)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
        return matrix(x.to(torch.bfloat16)).float(), x @ torch.from_numpy(reference).T
    got, want = on_thread(product)
    # bf16 activations, scales, zeros and output (two outputs for 5 to 8 bits): as dense bf16 weights, ~0.3 %
    assert float((got - want).norm() / want.norm()) < 0.01


@int4_cpu
def test_a_fused_product_of_mixed_types_is_its_parts_side_by_side(tmp_path):
    f = gguf.read(tiny_gguf(hidden=256, qtype="mix"))
    decoder = on_thread(lambda: weights.from_gguf(f, "int4"))
    qkv = decoder.layers[0].qkv.quant  # Q4_K, Q5_K (one form each), Q6_K (dense)
    assert isinstance(qkv, quant.Concat)
    assert [type(p) for p in qkv.parts] == [quant.Int4, quant.Sum, quant.Dense]
    assert decoder.formats()["qkv"] == "int4+int4x2+bfloat16"
    assert on_thread(lambda: weights.verify(f, decoder))


def test_q8_0_on_load_is_llama_cpps_q8_0():
    tensor, _ = blocks_of("Q8_0")
    weight = torch.from_numpy(np.random.default_rng(0).normal(0, 1, (48, 256)).astype(np.float32))  # blocks_of's
    mine = weights.q8_0(weight)
    theirs = gguf.affine(tensor)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


@int4_cpu
def test_a_hub_model_is_quantized_on_load_and_answers_as_its_dense_weights(tiny_model, tmp_path):
    def both():
        out = {}
        for mode in ("auto", "off"):
            settings = Settings.from_env({}, model=str(tiny_model), data_dir=str(tmp_path), quant=mode, dtype="auto")
            loaded = loader.load(settings)
            ids = loaded.tokenizer.encode("a fixed input for the quantized path")
            out[mode] = (loaded.weights, loaded.decoder.formats(), _prefill_logits(loaded.decoder, ids))
        return out
    out = on_thread(both)
    weights_q, formats, q8 = out["auto"]
    assert weights_q == "int4" and set(formats.values()) == {"int4x2"}
    assert out["off"][0] != "int4"
    dense = out["off"][2]
    assert float(torch.nn.functional.cosine_similarity(q8, dense, dim=0)) > 0.999
    assert int(q8.argmax()) == int(dense.argmax())


def test_llama_rows_undo_the_converters_interleaving():
    rows = weights._llama_rows(heads=2, head_dim=8)
    # Each head: transformers' row j * 4 + i is GGUF's row 2 i + j.
    assert rows.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def _prefill_logits(decoder, ids: list[int]):
    kv = decoder.cache(1, len(ids) + 8)
    kv.reserve(len(ids))
    kv.mask[0, :len(ids)] = 1
    return decoder(torch.tensor([ids]), kv, torch.arange(len(ids))[None])[0]


@pytest.fixture(scope="module")
def tiny_file():
    return tiny_gguf()


def test_own_decoder_on_a_llama_gguf_equals_transformers(tiny_file):
    from transformers import AutoModelForCausalLM

    def compare():
        tokenizer = loader.gguf_tokenizer(tiny_file)
        ids = tokenizer.encode("hello there, how are you today?")
        mine = _prefill_logits(weights.from_gguf(gguf.read(tiny_file), "off"), ids)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_file.parent), gguf_file=tiny_file.name,
                                                  dtype=torch.bfloat16).eval()
        return mine, hf(torch.tensor([ids])).logits[0, -1].float()
    mine, theirs = on_thread(compare)
    assert int(mine.argmax()) == int(theirs.argmax())
    assert float((mine - theirs).abs().max()) < 1e-2 * float(theirs.abs().max())


@int4_cpu
def test_quantized_forward_matches_dense(tiny_file):
    def both():
        f = gguf.read(tiny_file)
        ids = loader.gguf_tokenizer(tiny_file).encode("a fixed input for the quantized path")
        return _prefill_logits(weights.from_gguf(f, "int4"), ids), _prefill_logits(weights.from_gguf(f, "off"), ids)
    q4, dense = on_thread(both)
    cosine = float(torch.nn.functional.cosine_similarity(q4, dense, dim=0))
    assert cosine > 0.999, cosine
    assert int(q4.argmax()) == int(dense.argmax())


@int4_cpu
def test_self_check_passes_and_fails_on_a_wrong_kernel(tiny_file, monkeypatch):
    f = gguf.read(tiny_file)
    decoder = on_thread(lambda: weights.from_gguf(f, "int4"))
    assert decoder.weights == "int4"
    assert on_thread(lambda: weights.verify(f, decoder))
    real = quant._mm
    monkeypatch.setattr(quant, "_mm", lambda x, packed, group, scales: real(x, packed, group, scales).flip(-1))
    assert not on_thread(lambda: weights.verify(f, decoder))


@int4_cpu
def test_the_loader_falls_back_to_dense_when_the_self_check_fails(tiny_file, tmp_path, monkeypatch, caplog):
    real = quant._mm
    monkeypatch.setattr(quant, "_mm", lambda x, packed, group, scales: real(x, packed, group, scales) * 1.5)
    settings = Settings.from_env({}, model=str(tiny_file), data_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="chat.engine.model.loader"):
        loaded = on_thread(lambda: loader.load(settings))
    assert loaded.weights == "bfloat16" and loaded.decoder is not None
    assert "disagrees" in caplog.text


def test_calibrate_gives_each_shape_its_crossover():
    def run():
        linears = [quant.Linear(torch.randn(64, 32, dtype=torch.bfloat16),
                                quant.Int4(torch.zeros((64, 32), dtype=torch.uint8), torch.ones((64, 1)),
                                           torch.zeros((64, 1)))) for _ in range(3)]
        known = dict(crossover.calibrate(linears, {"64x32": 7}))
        measured = dict(crossover.calibrate(linears))
        return linears, known, measured
    linears, known, measured = on_thread(run)
    assert known == {"64x32": 7}
    assert set(measured) == {"64x32"} and 0 <= measured["64x32"] <= 64
    assert all(lin.crossover == measured["64x32"] for lin in linears)


def test_a_linear_takes_int4_for_small_decode_steps_and_dense_for_prefill(monkeypatch):
    calls = []

    class Spy:
        out_features = 4

        def __call__(self, x):
            calls.append(("int4", x.shape[0]))
            return torch.zeros(x.shape[0], 4, dtype=x.dtype)
    linear = quant.Linear(torch.zeros(4, 8, dtype=torch.bfloat16), Spy())
    linear.crossover = 8
    x = torch.zeros(8, 8, dtype=torch.bfloat16)
    linear(x)  # a decode step of 8 rows
    linear(x, decode=False)  # a prefill of 8 columns: dense
    linear(torch.zeros(9, 8, dtype=torch.bfloat16))  # past the crossover: dense
    assert calls == [("int4", 8)]


@pytest.fixture(scope="module")
def quant_engine(tiny_file, tmp_path_factory):
    # torch's decode step throughout: the C++ one (test_native.py) would switch in while the tests run
    settings = Settings.from_env({}, model=str(tiny_file), data_dir=str(tmp_path_factory.mktemp("q")),
                                 max_new_tokens=256, threads=1, native=False)
    engine = LocalEngine(settings)
    import time
    deadline = time.monotonic() + 120
    while not engine.ready:
        assert engine.error is None and time.monotonic() < deadline, engine.error
        time.sleep(0.05)
    yield engine
    engine.shutdown()


def _text(gen) -> str:
    return "".join(e.text for e in gen if isinstance(e, Delta))


@int4_cpu
def test_idle_chores_measure_and_keep_the_crossovers(quant_engine, tiny_file, tmp_path):
    import time
    deadline = time.monotonic() + 120
    while quant_engine.chores is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    linears = quant_engine.decoder.linears()
    assert all(lin.dense is not None and lin.quant is not None for lin in linears)
    assert all(0 <= lin.crossover < quant.Linear.ALWAYS for lin in linears)
    kept = json.loads((Path(quant_engine.settings.model_cache_dir) / "crossovers.json").read_text())
    (found,) = kept.values()
    assert found == {"x".join(map(str, lin.dense.shape)): lin.crossover for lin in linears}
    # A later start takes them from the file instead of measuring (a made-up value proves it).
    made_up = dict.fromkeys(found, 3)
    crossovers = Path(quant_engine.settings.model_cache_dir) / "crossovers.json"
    crossovers.write_text(json.dumps({next(iter(kept)): made_up}))
    loaded = on_thread(lambda: loader.load(quant_engine.settings))
    on_thread(lambda: list(loader.finish(loaded, quant_engine.settings)))
    assert {lin.crossover for lin in loaded.decoder.linears()} == {3}


def test_seeded_answers_repeat_on_the_quantized_path_alone_and_in_a_batch(quant_engine):
    expected = "int4" if loader.cpu_has_native_bf16() else "bfloat16"
    assert quant_engine.describe()["weights"] in (expected, "float32")
    ask = [{"role": "user", "content": "tell me something"}]
    params = GenParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=40)
    first = _text(quant_engine.submit(ask, params))
    assert first and _text(quant_engine.submit(ask, params)) == first
    others = [quant_engine.submit([{"role": "user", "content": f"other {i}"}],
                                  GenParams(temperature=1.0, max_new_tokens=60)) for i in range(3)]
    mine = quant_engine.submit(ask, params)
    assert _text(mine) == first
    for gen in others:
        _text(gen)
