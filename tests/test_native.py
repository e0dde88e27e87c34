"""The C++ decode step (chat/engine/kernels/native.cpp): built and kept, checked against torch's step,
a row's bits independent of its batch, used by the engine once built, and left alone when it
cannot be built or disagrees. Needs a C++ compiler (`make test` installs g++)."""
from __future__ import annotations

import logging
import time

import pytest
import torch
from helpers import QUESTIONS, ROOT, ask, collect, make_engine
from test_quant import int4_cpu, on_thread
from tinygguf import tiny_gguf

from chat.engine import GenParams
from chat.engine.kernels import build, cpu, gguf, quant
from chat.engine.model import native, weights

SHARED = ROOT / "data" / "model-cache"  # where the live test servers keep theirs: built once a checkout
MODES = ["off", pytest.param("int4", marks=int4_cpu)]


def drain(gen):
    """Run a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


@pytest.fixture(scope="module")
def library():
    path = drain(build.build(SHARED))
    assert path is not None and path.exists(), "the C++ decode step did not build (see the log)"
    build.load(path)
    return path


# The tiny llama (Q4_1 layers, Q8_0 table), a Qwen2 (q/k/v biases) whose layers mix K-quants, 5-bit and
# 8-bit types and a dense Q6_K part, with a dense Q6_K output layer: every form the step multiplies by; and a
# Qwen3 (q/k head norms); a SmolLM3 (a layer in four without rotary positions), a Phi-3 (fused products, rotary
# positions over 3/4 of a head, LongRoPE) and a Gemma 3 (its norms, GELU, a window of 4 on five layers of six).
FILES = {"llama": {}, "qwen2-mix": {"hidden": 256, "qtype": "mix", "arch": "qwen2", "head": "Q6_K"},
         "qwen3": {"arch": "qwen3", "head_dim": 32},  # per-head q/k norms, heads wider than hidden / heads
         "smollm3": {"arch": "smollm3", "layers": 4}, "phi3": {"arch": "phi3", "hidden": 128, "rotary": 24,
                                                                "longrope": True},
         "gemma3": {"arch": "gemma3", "head_dim": 32, "layers": 6, "window": 4},
         # Phi-3.5-mini's heads: 96 wide (not a multiple of 64), as many key/value heads as query heads
         "phi3-96": {"arch": "phi3", "hidden": 384, "heads": 4, "kv_heads": 4, "longrope": True}}


@pytest.fixture(scope="module", params=[("off", "llama"), pytest.param(("int4", "llama"), marks=int4_cpu),
                                        pytest.param(("int4", "qwen2-mix"), marks=int4_cpu),
                                        pytest.param(("blocks", "llama"), marks=int4_cpu),
                                        pytest.param(("blocks", "qwen2-mix"), marks=int4_cpu),
                                        ("off", "qwen3"), pytest.param(("blocks", "qwen3"), marks=int4_cpu),
                                        *(m for arch in ("smollm3", "phi3", "gemma3", "phi3-96") for m in (
                                            ("off", arch), pytest.param(("blocks", arch), marks=int4_cpu)))],
                ids="-".join)
def decoder(request, library):
    mode, file = request.param  # blocks: the library's block products (int4 everywhere else)
    f = gguf.read(tiny_gguf(**FILES[file]))
    return on_thread(lambda: weights.from_gguf(f, "int4" if mode == "blocks" else mode, blocks=mode == "blocks"))


def _batch(decoder, prompts: list[list[int]]):
    """A KV buffer with each prompt prefilled alone (torch) and added right-aligned, as the engine
    adds rows that finished prefilling; then the next column set for a decode step."""
    kv = decoder.cache(1, 8)
    kv.n = 0
    for ids in prompts:
        alone = decoder.cache(1, len(ids) + 4)
        alone.reserve(len(ids))
        alone.mask[0, :len(ids)] = 1
        decoder.forward(torch.tensor([ids]), alone, torch.arange(len(ids))[None])
        alone.length = len(ids)
        kv.add_row(*alone.row(0))
    kv.reserve(1)
    kv.mask[:kv.n, kv.length] = 1
    return kv


def _step(decoder, kv, tokens, positions, native_step):
    return decoder.forward(torch.tensor(tokens)[:, None], kv, torch.tensor(positions)[:, None], native=native_step)


PROMPTS = [[5, 9, 14, 3, 22, 7, 8], [11, 4], [30, 2, 2, 19, 40]]


def test_the_step_matches_torchs_over_several_steps(decoder):
    def run():
        step = native.Step(decoder)
        assert native.agrees(decoder, step)
        out = {}
        for name, how in (("torch", False), ("native", step)):
            kv, tokens, logits = _batch(decoder, PROMPTS), [1, 2, 3], []
            positions = [len(p) for p in PROMPTS]
            for _ in range(6):
                logits.append(_step(decoder, kv, tokens, positions, how))
                kv.length += 1
                kv.reserve(1)
                kv.mask[:kv.n, kv.length] = 1
                tokens = logits[-1].argmax(-1).tolist()
                positions = [p + 1 for p in positions]
            out[name] = torch.stack(logits)
        return out
    out = on_thread(run)
    mine, theirs = out["native"], out["torch"]
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert float((mine - theirs).abs().max()) < 2e-2 * float(theirs.abs().max())


def test_a_rows_result_does_not_depend_on_its_batch(decoder):
    """Bit for bit: alone, or beside longer and shorter rows (so behind padding), as the engine's
    seeded answers need."""
    def run():
        step = native.Step(decoder)
        alone = _step(decoder, _batch(decoder, [PROMPTS[1]]), [4], [2], step)
        batched = _step(decoder, _batch(decoder, PROMPTS), [1, 4, 3], [7, 2, 5], step)
        return alone[0], batched[1]
    alone, batched = on_thread(run)
    assert torch.equal(alone, batched)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds(decoder):
    def run():
        step = native.Step(decoder)
        kv = _batch(decoder, [PROMPTS[0]])
        h = decoder.embed(torch.tensor([1]))
        cos, sin = decoder._rope(torch.tensor([[7]]))
        good = dict(embedded=h, keys=kv.keys, values=kv.values, starts=torch.tensor([0]), col=kv.length,
                    cos=cos[:, 0, 0], sin=sin[:, 0, 0], local_cos=torch.empty(0), local_sin=torch.empty(0))
        for bad in (dict(starts=torch.tensor([9])),  # a row starting after the column it writes
                    dict(col=kv.capacity),  # past the buffer
                    dict(keys=kv.keys[:1], values=kv.values[:1]),  # a buffer per layer
                    dict(values=[v[:, :, :4] for v in kv.values]),  # values shaped as keys
                    dict(embedded=h[:, :32])):  # the model's hidden size
            args = {**good, **bad}
            with pytest.raises(RuntimeError):
                torch.ops.chat_native.decode(step.id, *args.values())
        return True
    assert on_thread(run)


def test_a_kept_build_is_loaded_not_rebuilt(library, monkeypatch):
    before = library.stat().st_mtime_ns
    monkeypatch.setattr(build, "command", lambda cxx, target: pytest.fail("compiled again"))
    assert drain(build.build(SHARED)) == library and library.stat().st_mtime_ns == before


def test_a_build_that_fails_is_logged_and_leaves_torch_ops(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "native.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(build, "SOURCES", (broken,))
    with caplog.at_level(logging.WARNING, logger="chat.engine.kernels.build"):
        assert drain(build.build(tmp_path)) is None
    assert "could not build the C++ decode step" in caplog.text
    assert not list((tmp_path / "native").glob("*.so*"))  # no half-written library left to load


def test_without_a_compiler_decode_steps_stay_on_torch(tmp_path, monkeypatch, caplog):
    decoder = on_thread(lambda: weights.from_gguf(gguf.read(tiny_gguf()), "off"))
    monkeypatch.setattr(build, "compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="chat.engine.kernels.build"):
        on_thread(lambda: drain(native.attach(decoder, tmp_path)))
    assert decoder.native is None and "no C++ compiler" in caplog.text


def test_an_unwritable_cache_folder_leaves_torch_ops(tmp_path, caplog):
    decoder = on_thread(lambda: weights.from_gguf(gguf.read(tiny_gguf()), "off"))
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="chat.engine.kernels.build"):
        on_thread(lambda: drain(native.attach(decoder, blocked)))
    assert decoder.native is None and "could not build the C++ decode step" in caplog.text


def test_a_model_shape_the_step_does_not_cover_leaves_torch_ops(library, caplog):
    # heads of 24 numbers: the C++ loops take multiples of 16
    decoder = on_thread(lambda: weights.from_gguf(gguf.read(tiny_gguf(hidden=96)), "off"))
    assert decoder.shape.head_dim == 24
    with caplog.at_level(logging.WARNING, logger="chat.engine.model.native"):
        on_thread(lambda: drain(native.attach(decoder, SHARED)))
    assert decoder.native is None and "does not run this model" in caplog.text


def test_a_step_that_disagrees_with_torch_is_not_used(library, monkeypatch, caplog):
    decoder = on_thread(lambda: weights.from_gguf(gguf.read(tiny_gguf()), "off"))
    real = native.Step.__call__
    monkeypatch.setattr(native.Step, "__call__", lambda self, *args: real(self, *args).roll(1, -1))
    with caplog.at_level(logging.WARNING, logger="chat.engine.model.native"):
        on_thread(lambda: drain(native.attach(decoder, SHARED)))
    assert decoder.native is None and "disagrees" in caplog.text


@int4_cpu
@pytest.mark.parametrize("file", list(FILES))
def test_the_float32_reference_is_a_float32_decoders_step(file):
    """``agrees``' yardstick (``Decoder.widened``): a bf16 decoder's step with activations in float32 comes out as
    a float32 decoder's of the same file (cosine above 0.999; its products' inputs still rounded to bf16, the int4
    kernel's scales in bf16), whatever the bf16 step's own roundings do to a sensitive row (the mixed Qwen2's first:
    0.974 from the float32 decoder's); the decoder left as it was."""
    f = gguf.read(tiny_gguf(**FILES[file]))

    def run():
        decoder = weights.from_gguf(f, "int4")
        ids = torch.arange(3, 3 + 2 * 9).remainder(decoder.shape.vocab).view(2, 9)
        eager = native._next_logits(decoder, ids, False)
        exact = native._next_logits(decoder.widened(), ids, False)
        f32 = native._next_logits(weights.from_gguf(f, "off", dtype=torch.float32), ids, False)
        return decoder, eager, exact, f32, native._next_logits(decoder, ids, False)
    decoder, eager, exact, f32, again = on_thread(run)
    assert decoder.dtype == torch.bfloat16 and torch.equal(eager, again)
    assert not torch.equal(eager, exact)
    assert float(torch.nn.functional.cosine_similarity(exact, f32, dim=-1).min()) > 0.999


def test_a_step_apart_from_torchs_by_rounding_alone_is_used_and_a_wrong_one_is_not(library, caplog):
    """A deep model of random weights carries one value rounded the other way through every later layer, past the
    cosine that passes at once (the Phi-3.5-mini shape file: two attention outputs of its first layer one bf16
    step apart, logits 0.9987 apart); measured against float32 activations, that step is no farther from them
    than torch's own, and is used. Rotary positions turned the wrong way, or cos and sin swapped, are refused
    on the same model all the same."""
    decoder = on_thread(lambda: weights.from_gguf(gguf.read(tiny_gguf(layers=8)), "off"))

    def rounded(step):  # two of a row's inputs one bf16 step up: what a rounding the other way does
        def call(h, *rest):
            h = h.clone()
            h.view(torch.int16)[0, :2] += 1
            return step(h, *rest)
        return call

    def run():
        step = native.Step(decoder)
        ids = torch.arange(3, 3 + 2 * 9).remainder(decoder.shape.vocab).view(2, 9)
        cosine = torch.nn.functional.cosine_similarity(native._next_logits(decoder, ids, False),
                                                       native._next_logits(decoder, ids, rounded(step)), dim=-1)
        wrong = [lambda h, kv, cos, sin, *rest: step(h, kv, cos, -sin, *rest),
                 lambda h, kv, cos, sin, *rest: step(h, kv, sin, cos, *rest)]
        with caplog.at_level(logging.INFO, logger="chat.engine.model.native"):
            return (float(cosine.min()), native.agrees(decoder, rounded(step)), caplog.text,
                    [native.agrees(decoder, w) for w in wrong])
    cosine, used, said, wrong = on_thread(run)
    assert cosine < native.NEAR  # past the first test: judged against float32 activations
    assert used and "by rounding" in said
    assert wrong == [False, False]


@pytest.fixture(scope="module")
def native_engine(tiny_model, tmp_path_factory, library):
    """The engine in bfloat16 (the C++ step's type) once the C++ step has switched in."""
    engine = make_engine(tiny_model, tmp_path_factory.mktemp("native"), dtype="bfloat16", native=True,
                         cache_dir=str(SHARED))
    deadline = time.monotonic() + 120
    while engine.stats()["finishing"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield engine
    engine.shutdown()


def test_the_engine_switches_to_the_step_and_seeded_answers_repeat_in_a_batch(native_engine):
    engine = native_engine
    assert engine.stats()["decode"] == "native"
    if quant.quantized(cpu.detect().isa):  # quantized on load straight onto the block products (a kept build)
        assert engine.describe()["weights"] == "blocks" and set(engine.describe()["formats"].values()) == {"q8"}
    params = GenParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=40)
    alone = collect(engine.submit(ask("sample me"), params))[0]
    others = [engine.submit(ask(q), GenParams(temperature=1.0, max_new_tokens=80)) for q in QUESTIONS]
    mine = engine.submit(ask("sample me"), params)
    assert collect(mine)[0] == alone and alone
    for g in others:
        collect(g)


def test_the_c_sampler_draws_what_the_torch_sampler_draws(library):
    """Every filter and their mixes, peaked and flat distributions, greedy rows beside sampled ones:
    the same tokens from the same uniform numbers, but where the draw lands within rounding of the
    border between two tokens (its sums run in another order than torch's): then a neighbour."""
    from chat.engine.model.sampling import sample

    cases = [dict(temperature=0.0), dict(temperature=0.7, top_p=1.0), dict(temperature=1.3, top_p=0.9),
             dict(temperature=0.7, top_k=40), dict(temperature=1.0, min_p=0.05),
             dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02), dict(temperature=2.0, top_p=0.5)]
    gen = torch.Generator().manual_seed(3)
    same = draws = 0
    for scale in (1.0, 4.0, 12.0):  # flat to peaked
        logits = torch.randn(len(cases), 4096, generator=gen) * scale
        rank = logits.argsort(dim=-1, descending=True).argsort(dim=-1)  # each token's place, most likely first
        for seed in range(20):
            params = [GenParams(**c) for c in cases]
            mine = sample(logits, params, [torch.Generator().manual_seed(seed) for _ in cases], native=native.sample)
            theirs = sample(logits, params, [torch.Generator().manual_seed(seed) for _ in cases])
            for row, (a, b) in enumerate(zip(mine, theirs)):
                draws += 1
                same += a == b
                # without filters the draw walks the vocabulary in its order, else most likely first
                places = (a, b) if row == 1 else (int(rank[row, a]), int(rank[row, b]))
                assert abs(places[0] - places[1]) <= 1, (scale, seed, row, a, b)
    assert same >= 0.97 * draws, (same, draws)
    # top-k past the tokens near the most likely: the sampler looks further
    peaked = torch.tensor([[30.0] + [-float(i) for i in range(1, 200)]])
    assert sample(peaked, [GenParams(temperature=1.0, top_k=20)], [torch.Generator().manual_seed(0)],
                  native=native.sample) == [0]


def test_a_long_prompt_joining_running_rows_changes_no_answer(native_engine, monkeypatch):
    """With the C++ step the batch's padding is never read, so a row longer than the running ones
    joins without zeroing their new padding (a long join stalled them most of a second): every
    answer is still its solo answer."""
    from chat.engine import Delta

    engine = native_engine
    short, long_text = ask("hi"), ask(" ".join(f"word{i}" for i in range(300)))
    # Every prompt prefilled whole, from its first token: a prompt continued from a shared preamble's KV
    # rounds a little apart in bf16, and whether one is held depends on the engine's idle time.
    monkeypatch.setattr(engine.prefix, "want", lambda ids, salt=None: None)
    engine.prefix.wanted.clear()
    engine.prefix.preambles.clear()
    running, late = GenParams(temperature=0, max_new_tokens=400), GenParams(temperature=0, max_new_tokens=24)
    expected = [collect(engine.submit(short, running))[0], collect(engine.submit(long_text, late))[0]]
    first = engine.submit(short, running)
    head = next(e.text for e in first if isinstance(e, Delta))
    second = engine.submit(long_text, late)
    late_head = next(e.text for e in second if isinstance(e, Delta))
    kv = engine.batch.kv  # both rows are in it now
    assert kv is not None and not kv.reads_padding
    # The running row's answer is its solo answer (its padding was never read). The late row's prompt is
    # prefilled in chunks sized by time beside the running row, and a prompt's last column in a chunk of
    # its own, or attention over chunks of other widths, rounds a little apart in bf16: its answer is its
    # own, not necessarily bit for bit its solo one (seeded prompts are kept invariant by other means).
    assert head + collect(first)[0] == expected[0]
    assert late_head + collect(second)[0]


def test_an_architecture_needing_what_the_step_does_not_compute_stays_on_torch(library, monkeypatch):
    from dataclasses import replace

    from chat.engine.model.architecture import ARCHITECTURES, FEATURES

    def run():
        decoder = weights.from_gguf(gguf.read(tiny_gguf()), "off")
        assert decoder.architecture.name == "llama" and decoder.architecture.features <= native.COVERS
        # every feature a description names is computed, so every architecture runs its decode steps in C++
        assert set(FEATURES) <= native.COVERS and all(a.features <= native.COVERS for a in ARCHITECTURES.values())
        # one that is not (as a new feature would be before the step computes it) keeps torch's steps
        monkeypatch.setattr(native, "COVERS", native.COVERS - {"sliding_window"})
        decoder.architecture = replace(decoder.architecture, features=frozenset({"qkv_bias", "sliding_window"}))
        with pytest.raises(RuntimeError, match="sliding_window"):
            native.Step(decoder)
        return True
    assert on_thread(run)


@int4_cpu
def test_a_gguf_loaded_before_the_build_moves_onto_the_block_products(tmp_path, library, monkeypatch):
    """A first start (no build kept yet) serves on the int4 kernel; once the library is built the
    products move onto its blocks, checked first, and answers go on."""
    monkeypatch.setattr(build, "kept", lambda cache_dir, cpu=None: False)
    engine = make_engine(tiny_gguf(), tmp_path, dtype="bfloat16", native=True, cache_dir=str(SHARED))
    try:
        assert engine.describe()["weights"] == "int4"
        deadline = time.monotonic() + 120
        while engine.stats()["finishing"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert engine.describe()["weights"] == "blocks" and engine.stats()["decode"] == "native"
        assert engine.describe()["formats"] == {"qkv": "q4", "o": "q4", "gate_up": "q4", "down": "q4", "output": "q8"}
        text = collect(engine.submit(ask("hello"), GenParams(temperature=0, max_new_tokens=12)))[0]
        assert text
    finally:
        engine.shutdown()


@int4_cpu
def test_newcomers_together_each_start_from_the_preamble_on_the_block_kernels(native_engine):
    """On the block kernels a forward costs in proportion to its rows: newcomers arriving together each
    start from their system prompt's preamble instead of sharing one forward over their whole prompts."""
    from helpers import until

    from chat.engine import Done
    from chat.engine.core import prompt

    engine = native_engine
    assert engine.describe()["weights"] == "blocks" and not engine.queue.wide_prefill
    params = GenParams(temperature=0, max_new_tokens=4)
    collect(engine.submit(ask("warm the preamble"), params))
    mine = prompt.preamble(engine.loaded.tokenizer, ask("x"))
    assert until(lambda: engine.prefix.has_preamble(mine), timeout=60)
    gens = [engine.submit(ask(q), params) for q in QUESTIONS]
    done = [next(e for e in collect(g)[1] if isinstance(e, Done)) for g in gens]
    assert all(d.reused_tokens >= len(mine) for d in done), [d.reused_tokens for d in done]


@int4_cpu
def test_a_hub_model_loaded_before_the_build_moves_onto_the_block_products(tiny_model, tmp_path, monkeypatch):
    """A hub or folder model quantized on load before the library is built (a first start) serves on the
    int4 kernel, then is read again and moved onto the block products once the library is built."""
    monkeypatch.setattr(build, "kept", lambda cache_dir, cpu=None: False)
    engine = make_engine(tiny_model, tmp_path, dtype="bfloat16", native=True, cache_dir=str(SHARED))
    try:
        assert engine.describe()["weights"] == "int4"
        params = GenParams(temperature=0, max_new_tokens=12)
        deadline = time.monotonic() + 120
        while engine.stats()["finishing"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert engine.describe()["weights"] == "blocks" and engine.stats()["decode"] == "native"
        assert set(engine.describe()["formats"].values()) == {"q8"}
        assert collect(engine.submit(ask("hello"), params))[0]
    finally:
        engine.shutdown()
