"""GGUF weights on the int4 kernel: the block mapping, the own decoder against transformers, the
start-up self-check and its fallback, and the engine on a quantized model."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from chat.config import Settings
from chat.engine import Delta, GenParams, gguf, quant, weights
from chat.engine import model as loader
from chat.engine.local import LocalEngine
from tinygguf import tiny_gguf

torch = pytest.importorskip("torch")
native_bf16 = pytest.mark.skipif(not loader.cpu_has_native_bf16(), reason="the int4 path needs a CPU with native bf16")


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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_contents_match_gguf_py(kind):
    tensor, reference = synthetic(kind)
    assert np.array_equal(gguf.dequantize(tensor).numpy(), reference)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_parts_are_the_blocks_weights(kind):
    tensor, reference = synthetic(kind)
    q, scale, zero = gguf.int4_parts(tensor)
    assert q.dtype == torch.uint8 and int(q.min()) >= 0 and int(q.max()) <= 15
    rebuilt = (q.reshape(48, -1, 32).float() - 8) * scale[..., None] + zero[..., None]
    np.testing.assert_allclose(rebuilt.reshape(48, 96).numpy(), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_the_int4_kernel_multiplies_by_the_blocks_weights(kind):
    tensor, reference = synthetic(kind)

    def product():
        matrix = quant.Int4(*gguf.int4_parts(tensor))
        x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
        return matrix(x.to(torch.bfloat16)).float(), x @ torch.from_numpy(reference).T
    got, want = on_thread(product)
    assert float((got - want).norm() / want.norm()) < 0.01  # bf16 activations, scales and output


def test_q8_0_as_two_int4_products_is_exact_but_for_bf16_scales():
    tensor, _ = synthetic("Q8_0", rows=64, cols=128)
    q, d = gguf.int8_parts(tensor)
    # The weights the two products stand for: d rounded to bf16, times q.
    d16 = d.to(torch.bfloat16).float()
    reference = (q.reshape(64, -1, 32).float() * d16[..., None]).reshape(64, 128).numpy()

    def product():
        pair = quant.Int8Pair(q, d)
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
        return pair(x.to(torch.bfloat16)).float(), x.to(torch.bfloat16).float() @ torch.from_numpy(reference).T
    got, want = on_thread(product)
    assert float((got - want).norm() / want.norm()) < 0.01


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


@native_bf16
def test_quantized_forward_matches_dense(tiny_file):
    def both():
        f = gguf.read(tiny_file)
        ids = loader.gguf_tokenizer(tiny_file).encode("a fixed input for the quantized path")
        return _prefill_logits(weights.from_gguf(f, "int4"), ids), _prefill_logits(weights.from_gguf(f, "off"), ids)
    q4, dense = on_thread(both)
    cosine = float(torch.nn.functional.cosine_similarity(q4, dense, dim=0))
    assert cosine > 0.999, cosine
    assert int(q4.argmax()) == int(dense.argmax())


@native_bf16
def test_self_check_passes_and_fails_on_a_wrong_kernel(tiny_file, monkeypatch):
    f = gguf.read(tiny_file)
    decoder = on_thread(lambda: weights.from_gguf(f, "int4"))
    assert decoder.weights == "int4"
    assert on_thread(lambda: weights.verify(f, decoder))
    real = quant._mm
    monkeypatch.setattr(quant, "_mm", lambda x, packed, group, scales: real(x, packed, group, scales).flip(-1))
    assert not on_thread(lambda: weights.verify(f, decoder))


@native_bf16
def test_the_loader_falls_back_to_dense_when_the_self_check_fails(tiny_file, tmp_path, monkeypatch, caplog):
    real = quant._mm
    monkeypatch.setattr(quant, "_mm", lambda x, packed, group, scales: real(x, packed, group, scales) * 1.5)
    settings = Settings.from_env({}, model=str(tiny_file), data_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="chat.engine.model"):
        loaded = on_thread(lambda: loader.load(settings))
    assert loaded.weights == "bfloat16" and loaded.decoder is not None
    assert "disagrees" in caplog.text


def test_calibrate_gives_each_shape_its_crossover():
    def run():
        linears = [quant.Linear(torch.randn(64, 32, dtype=torch.bfloat16),
                                quant.Int4(torch.zeros((64, 32), dtype=torch.uint8), torch.ones((64, 1)),
                                           torch.zeros((64, 1)))) for _ in range(3)]
        known = dict(quant.calibrate(linears, {"64x32": 7}))
        measured = dict(quant.calibrate(linears))
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


@native_bf16
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
    assert quant_engine.weights in (expected, "float32")
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
