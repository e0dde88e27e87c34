"""The architectures the own decoder runs beyond Llama and Qwen2, each against transformers' own implementation
of it on a tiny random GGUF written with gguf-py: the same logits after a prefill, the same 64 greedy tokens
(in float32, where neither side's rounding can flip a near tie), the file loaded onto the own decoder, not
transformers' forward, and served by the engine on the C++ step with its prefix cache and KV on disk. The C++
step against torch's is tests/test_native.py's (its FILES), drafts tests/test_drafts.py's (the same files)."""
from __future__ import annotations

import time

import pytest
import torch

from chat.config import Settings
from chat.engine import GenParams
from chat.engine.kernels import gguf
from chat.engine.kv.buffer import TRIM_SLACK
from chat.engine.model import loader, weights
from chat.engine.model.architecture import ARCHITECTURES
from helpers import QUESTIONS, ask, collect, make_engine
from test_native import SHARED, library  # noqa: F401  (the library fixture)
from test_quant import on_thread
from tinygguf import LONGROPE, longrope_attention, longrope_factors, tiny_gguf

# arch -> tiny_gguf's arguments, and what transformers must be told that its GGUF reader does not take from
# the file (Qwen3's head size: its reader keeps the config's default of 128). Llama is here for the engine test.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # small: most frequencies of a tiny head are scaled
TINY = {"qwen3": ({"arch": "qwen3", "head_dim": 32}, {"head_dim": 32}),
        "llama3": ({"head_dim": 32, "hidden": 128, "rope_scaling": LLAMA3_ROPE},
                   {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0}}),
        # q/k norms, norms after attention and MLP, GELU, a window of 8 on five layers of six; transformers' query
        # scale is told the head size, as llama.cpp scales Gemma 3's attention
        "gemma3": ({"arch": "gemma3", "head_dim": 32, "layers": 6, "window": 8}, {"query_pre_attn_scalar": 32}),
        # a layer in four without rotary positions (4 layers: the last); transformers' GGUF reader has no smollm3,
        # so its SmolLM3 takes the weights of the same file written as llama (``_transformers``)
        "smollm3": ({"arch": "smollm3", "layers": 4}, {}),
        # fused q/k/v and gate/up, rotary positions over 3/4 of each head (Phi-4-mini's), LongRoPE's factors: its
        # reader takes neither the rotary part nor the factors from the file
        "phi3": ({"arch": "phi3", "hidden": 128, "rotary": 24, "longrope": True},
                 {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": longrope_factors(24, "short"),
                                      "long_factor": longrope_factors(24, "long"),
                                      "attention_factor": longrope_attention(), **LONGROPE},
                  # (its config keeps its own original context, 4096, unless told at the top level too)
                  "max_position_embeddings": LONGROPE["max_position_embeddings"],
                  "original_max_position_embeddings": LONGROPE["original_max_position_embeddings"]}),
        "llama": ({}, {})}
PROMPT = "hello there, how are you today? I am fine, thank you, and I hope that you are well too."


def _transformers(path, overrides: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    if "-smollm3-" in path.name:  # the same weights written as llama (tiny_gguf draws them in the same order)
        from transformers import SmolLM3Config, SmolLM3ForCausalLM
        llama = _transformers(path.with_name(path.name.replace("-smollm3-", "-llama-")), overrides, dtype)
        assert llama.config.model_type == "llama"
        config = SmolLM3Config(**{k: v for k, v in llama.config.to_dict().items()
                                  if k not in ("model_type", "architectures")})
        assert config.no_rope_layers == [1, 1, 1, 0]  # transformers' default: every fourth without
        model = SmolLM3ForCausalLM(config).to(dtype)
        model.load_state_dict(llama.state_dict())
        return model.eval()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                dtype=dtype).eval()


def _greedy(decoder, ids: list[int], steps: int) -> list[int]:
    """The own decoder's greedy tokens: one prefill, then a decode step a token (torch's ops)."""
    kv = decoder.cache(1, len(ids) + steps + 1)
    kv.open(len(ids))
    logits = decoder.forward(torch.tensor([ids]), kv, torch.arange(len(ids))[None])
    kv.advance(len(ids))
    out = []
    for i in range(steps):
        out.append(int(logits[0].argmax()))
        kv.open(1)
        logits = decoder.forward(torch.tensor([[out[-1]]]), kv, torch.tensor([[len(ids) + i]]))
        kv.advance(1)
    return out


MATCHED = ["qwen3", "llama3", "gemma3", "smollm3", "phi3"]  # the files compared with transformers' implementation
# (the prompt is longer than Gemma's window of 8: the windowed layers see part of it)


@pytest.mark.parametrize("arch", MATCHED)
def test_the_prefill_logits_are_transformers(arch):
    args, overrides = TINY[arch]
    path = tiny_gguf(**args)
    if arch == "smollm3":
        tiny_gguf(**{**args, "arch": "llama"})

    def both():
        ids = loader.gguf_tokenizer(path).encode(PROMPT)
        decoder = weights.from_gguf(gguf.read(path), "off")
        kv = decoder.cache(1, len(ids) + 1)
        kv.open(len(ids))
        mine = decoder.forward(torch.tensor([ids]), kv, torch.arange(len(ids))[None])[0]
        theirs = _transformers(path, overrides, torch.bfloat16)(torch.tensor([ids])).logits[0, -1].float()
        return mine, theirs
    mine, theirs = on_thread(both)
    assert int(mine.argmax()) == int(theirs.argmax())
    # bf16 on both sides, rounded at other places (transformers' attention in bf16, ours in float32): Gemma's
    # six layers with two more norms each come out ~1.3% of the largest logit apart; float32 is exact below
    assert float((mine - theirs).abs().max()) < 2e-2 * float(theirs.abs().max())


@pytest.mark.parametrize("arch", MATCHED)
def test_64_greedy_tokens_are_transformers_generate(arch):
    args, overrides = TINY[arch]
    path = tiny_gguf(**args)
    if arch == "smollm3":
        tiny_gguf(**{**args, "arch": "llama"})

    def both():
        ids = loader.gguf_tokenizer(path).encode(PROMPT)
        mine = _greedy(weights.from_gguf(gguf.read(path), "off", dtype=torch.float32), ids, 64)
        model = _transformers(path, overrides, torch.float32)
        out = model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        return mine, out[0, len(ids):].tolist()
    mine, theirs = on_thread(both)
    assert len(mine) == 64 and mine == theirs


def test_llama3_scaling_changes_the_answer():
    """The scaled file's factors are read and used: without them (the same weights) the logits differ."""
    path = tiny_gguf(**TINY["llama3"][0])

    def both():
        ids = loader.gguf_tokenizer(path).encode(PROMPT)
        f = gguf.read(path)
        scaled = weights.from_gguf(f, "off", dtype=torch.float32)
        assert scaled.shape.rope_factors is not None and max(scaled.shape.rope_factors) == 8.0
        del f.tensors["rope_freqs.weight"]
        plain = weights.from_gguf(f, "off", dtype=torch.float32)
        return _greedy(scaled, ids, 8), _greedy(plain, ids, 8)
    scaled, plain = on_thread(both)
    assert scaled != plain


def test_smollm3s_layers_without_rotary_positions_and_phi3s_longrope_change_the_answer():
    """What makes SmolLM3 and Phi-3 more than llama is used: without it (the same weights) the answer differs."""
    def both(arch: str, drop) -> tuple[list[int], list[int]]:
        path = tiny_gguf(**TINY[arch][0])
        ids = loader.gguf_tokenizer(path).encode(PROMPT)
        f = gguf.read(path)
        decoder = weights.from_gguf(f, "off", dtype=torch.float32)
        return _greedy(decoder, ids, 8), _greedy(drop(f, decoder), ids, 8)

    def smollm3(f, decoder):
        assert decoder.shape.no_rope == (3,)
        decoder.shape.no_rope = ()  # rotary positions on every layer, as llama
        return decoder

    def phi3(f, decoder):
        assert decoder.shape.rotary == 24 and decoder.shape.rope_attention > 1
        assert decoder.shape.rope_factors == pytest.approx(longrope_factors(24, "short"))
        del f.tensors["rope_factors_short.weight"], f.tensors["rope_factors_long.weight"]
        return weights.from_gguf(f, "off", dtype=torch.float32)
    for arch, drop in (("smollm3", smollm3), ("phi3", phi3)):
        kept, dropped = on_thread(lambda arch=arch, drop=drop: both(arch, drop))
        assert kept != dropped, arch


def test_a_windowed_layer_attends_over_its_window_only(monkeypatch):
    """Gemma 3's windowed layers: a long prompt prefilled in chunks and decode steps after it give the logits of a
    prefill in one piece, while each windowed layer's attention reads at most its window and the new columns
    (its cost bounded by the window, not the context); the global layer reads everything."""
    from chat.engine.model import decoder as decoder_module
    path = tiny_gguf(**TINY["gemma3"][0])  # a window of 8, layer 6 global
    window, chunk = 8, 4
    real, read = decoder_module._attend, []
    monkeypatch.setattr(decoder_module, "_attend", lambda q, keys, *a: read.append((q.shape[2], keys.shape[2]))
                        or real(q, keys, *a))

    def run():
        ids = loader.gguf_tokenizer(path).encode(PROMPT + " " + PROMPT)[:32]
        decoder = weights.from_gguf(gguf.read(path), "off", dtype=torch.float32)
        whole = decoder.cache(1, len(ids))
        whole.open(len(ids))
        want = decoder.forward(torch.tensor([ids]), whole, torch.arange(len(ids))[None])
        read.clear()
        kv = decoder.cache(1, len(ids))
        for at in range(0, len(ids), chunk):
            kv.open(chunk)
            got = decoder.forward(torch.tensor([ids[at:at + chunk]]), kv, torch.arange(at, at + chunk)[None])
            kv.advance(chunk)
        return want, got
    want, got = on_thread(run)
    assert torch.allclose(want, got, atol=1e-4 * float(want.abs().max()))
    calls = [read[i:i + 6] for i in range(0, len(read), 6)]  # each chunk's six layers
    assert len(calls) == 8 and all(len(c) == 6 for c in calls)
    for n, layers in enumerate(calls):
        assert layers[5][1] == (n + 1) * chunk  # the global layer: every key so far
        assert all(keys <= min(window - 1 + chunk, (n + 1) * chunk) for _, keys in layers[:5])
    assert max(keys for layers in calls for _, keys in layers[:5]) == window - 1 + chunk


def test_a_qwen3_gguf_loads_onto_the_own_decoder(tmp_path):
    path = tiny_gguf(**TINY["qwen3"][0])
    settings = Settings.from_env({}, model=str(path), data_dir=str(tmp_path))
    loaded = on_thread(lambda: loader.load(settings))
    assert loaded.decoder is not None and loaded.decoder.architecture is ARCHITECTURES["qwen3"]
    layer = loaded.decoder.layers[0]
    assert layer.q_norm is not None and layer.k_norm is not None and layer.q_norm.shape == (32,)
    assert loaded.decoder.shape.head_dim == 32 and loaded.decoder.shape.hidden == 64


def test_a_qwen3_file_without_its_head_norms_is_refused_not_half_read(tmp_path):
    """The description says q/k norms; a file that lacks them is not silently run without."""
    path = tiny_gguf(**TINY["qwen3"][0])
    f = gguf.read(path)
    del f.tensors["blk.0.attn_q_norm.weight"]
    try:
        on_thread(lambda: weights.from_gguf(f, "off"))
    except weights.Unsupported as exc:
        assert "attn_q_norm" in str(exc)
    else:
        raise AssertionError("a qwen3 file without q/k norms loaded")


@pytest.mark.parametrize("arch", sorted(TINY))
def test_seeded_answers_in_a_batch_are_each_alones_on_the_cxx_step(arch, tmp_path, library):  # noqa: F811
    """Seeded, sampled prompts sent together, each prefilled in a job of its own and cut into the same chunks as
    alone (not by the time others' decoding leaves: that would round apart, and Gemma 3's flat random file turns
    any rounding into another token), give each its answer alone."""
    path = tiny_gguf(**TINY[arch][0])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "native").symlink_to(SHARED / "native", target_is_directory=True)
    engine = _native(make_engine(path, tmp_path / "data", dtype="bfloat16", native=True, cache_dir=str(cache)))
    try:
        assert engine.describe()["decode"] == "native"
        seeded = GenParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=24)  # the same in any batch
        alone = {q: collect(engine.submit(ask(q), seeded))[0] for q in QUESTIONS}
        together = [engine.submit(ask(q), seeded) for q in QUESTIONS]
        assert [collect(g)[0] for g in together] == [alone[q] for q in QUESTIONS]
    finally:
        _stopped(engine)


def _stopped(engine) -> None:
    engine.shutdown()
    deadline = time.monotonic() + 60
    while not engine.closed:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _native(engine):
    """``engine`` once its idle chores are done: the C++ step built (or found) and checked."""
    deadline = time.monotonic() + 300
    while engine.stats()["finishing"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return engine


@pytest.mark.parametrize("arch", sorted(TINY))
def test_the_engine_serves_it_on_the_cxx_step_with_the_prefix_cache_and_kv_from_disk(arch, tmp_path, library):  # noqa: F811
    """Prefill, decode steps in C++, a conversation's second turn from the prefix cache, and the same turn after
    a restart from the KV on disk: the same greedy answer both ways."""
    path = tiny_gguf(**TINY[arch][0])
    params = GenParams(temperature=0, max_new_tokens=24)
    turn1 = ask("Tell me about the sea, the wind and the long grey harbour walls.")

    def start(name: str):
        # Every engine with a KV disk, each in its own cache folder (the C++ library's shared): with and without
        # one, the last prompt column's keys come out a rounding apart (seen on llama too), which a random
        # model's near ties can amplify.
        cache = tmp_path / name / "cache"
        if not cache.exists():
            cache.mkdir(parents=True)
            (cache / "native").symlink_to(SHARED / "native", target_is_directory=True)
        return _native(make_engine(path, tmp_path / name / "data", dtype="bfloat16", native=True,
                                   cache_dir=str(cache), kv_disk_mb=64))
    warm = start("warm")  # turn 2 from the prefix cache in memory
    try:
        facts = warm.describe()
        assert facts["decode"] == "native" and facts["weights"] != "float32", facts
        first = collect(warm.submit(turn1, params, key="c1"))[0]
        turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the boats?"}]
        expected, events = collect(warm.submit(turn2, params, key="c1"))
        reused = events[-1].reused_tokens
        assert first and expected and reused > 0
    finally:
        _stopped(warm)
    engine = start("disk")
    try:
        assert collect(engine.submit(turn1, params, key="c1"))[0] == first
    finally:
        _stopped(engine)  # the entry is on disk once the engine has stopped
    again = start("disk")
    try:
        answer, events = collect(again.submit(turn2, params, key="c1"))
        assert events[-1].reused_tokens == reused and answer == expected
        assert again.prefix.disk is not None and again.prefix.disk.reads == 1
    finally:
        _stopped(again)


def test_gemma3_on_torchs_decode_steps_answers_the_same_in_a_batch_as_alone(tmp_path):
    """Before the C++ step (or without it), torch's decode steps run the windowed layers over each run of rows' own
    columns, cut to the window: a seeded answer beside others (longer and shorter rows, past the window of 8) is
    the one it gives alone."""
    path = tiny_gguf(**TINY["gemma3"][0])
    engine = make_engine(path, tmp_path, dtype="bfloat16", native=False, draft="off")
    try:
        assert engine.describe()["decode"] == "torch"
        seeded = GenParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=24)
        questions = [PROMPT, *QUESTIONS]
        alone = {q: collect(engine.submit(ask(q), seeded))[0] for q in questions}
        together = [engine.submit(ask(q), seeded) for q in questions]
        assert [collect(g)[0] for g in together] == [alone[q] for q in questions]
    finally:
        _stopped(engine)


def test_a_smollm3_checkpoint_runs_on_the_own_decoder_with_its_no_rope_layers():
    """A transformers SmolLM3 (a hub or folder model) is read onto the own decoder with its config's no_rope_layers
    (here not the default interval), and answers as transformers' generate does, 32 greedy tokens in float32."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    def both():
        torch.manual_seed(0)
        config = SmolLM3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0, 1],
                               tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = SmolLM3ForCausalLM(config).float().eval()
        for p in model.parameters():  # wide weights: no near ties
            p.data.normal_(0, 0.2)
        ids = list(range(3, 40))
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        decoder = weights.from_hf(model)
        return decoder.shape.no_rope, _greedy(decoder, ids, 32), want[0, len(ids):].tolist()
    no_rope, mine, theirs = on_thread(both)
    assert no_rope == (1,) and mine == theirs


def test_gemma3s_windowed_layers_keep_only_their_window_between_turns(tmp_path, library):  # noqa: F811
    """A conversation longer than the window: its entry in the prefix cache and on disk keeps the windowed layers'
    last columns only (their window and TRIM_SLACK more; the global layer all of them), and the next turn goes on
    from it, in memory and after a restart from disk, with the answer a full prefill gives."""
    path = tiny_gguf(**TINY["gemma3"][0])  # a window of 8 on layers 1-5, layer 6 global
    params = GenParams(temperature=0, max_new_tokens=24)
    turn1 = ask("Tell me about the sea, the wind and the long grey harbour walls, the gulls over the fish market, "
                "the ferry that leaves at dawn, the lighthouse keeper and his dog, and the storms of last winter "
                "that broke the old pier in two.")
    kept = 8 - 1 + TRIM_SLACK

    def start(name: str):
        cache = tmp_path / name / "cache"
        if not cache.exists():
            cache.mkdir(parents=True)
            (cache / "native").symlink_to(SHARED / "native", target_is_directory=True)
        return _native(make_engine(path, tmp_path / name / "data", dtype="bfloat16", native=True,
                                   cache_dir=str(cache), kv_disk_mb=64, draft="off"))
    engine = start("warm")
    try:
        first = collect(engine.submit(turn1, params, key="c1"))[0]
        _, keys, values, _, _ = engine.prefix.entries["c1"]
        total = keys[5].shape[2]
        assert total > kept + 8 and [k.shape[2] for k in keys[:5]] == [kept] * 5 == [v.shape[2] for v in values[:5]]
        turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the boats?"}]
        warm_answer, events = collect(engine.submit(turn2, params, key="c1"))
        reused = events[-1].reused_tokens
        assert reused > total - TRIM_SLACK
        engine.prefix.disk.flush()
        ids, keys, _ = engine.prefix.disk.load("c1")
        assert [k.shape[2] for k in keys] == [kept] * 5 + [len(ids)]  # trimmed on disk too
    finally:
        _stopped(engine)
    again = start("warm")  # the same cache folder: c1 from disk
    try:
        answer, events = collect(again.submit(turn2, params, key="c1"))
        assert again.prefix.disk.reads >= 1 and events[-1].reused_tokens > 0 and answer == warm_answer
    finally:
        _stopped(again)
    cold = start("cold")  # nothing held: the whole prompt prefilled
    try:
        answer, events = collect(cold.submit(turn2, params, key="c1"))
        assert events[-1].reused_tokens == 0 and answer == warm_answer
    finally:
        _stopped(cold)


def test_phi3_past_its_original_context_takes_the_long_factors_as_llama_cpp():
    """A context past the model's original one (``CHAT_CONTEXT_TOKENS``) serves every position with LongRoPE's
    long factors, as llama.cpp does; transformers takes them for a sequence past the original length, so a
    prompt that long agrees with it, and the short factors (a context within the original) do not."""
    args, overrides = TINY["phi3"]
    path = tiny_gguf(**args)
    original = LONGROPE["original_max_position_embeddings"]

    def run():
        ids = loader.gguf_tokenizer(path).encode(PROMPT * 20)[:original + 40]
        assert len(ids) == original + 40
        f = gguf.read(path)
        assert weights.longrope(f, original) == "short" and weights.longrope(f, original + 1) == "long"
        long, short = (weights.from_gguf(f, "off", context=c) for c in (LONGROPE["max_position_embeddings"], 0))
        assert long.shape.rope_factors == pytest.approx(longrope_factors(24, "long"))
        assert short.shape.rope_factors == pytest.approx(longrope_factors(24, "short"))
        out = []
        for decoder in (long, short):
            kv = decoder.cache(1, len(ids) + 1)
            kv.open(len(ids))
            out.append(decoder.forward(torch.tensor([ids]), kv, torch.arange(len(ids))[None])[0])
        theirs = _transformers(path, overrides, torch.bfloat16)(torch.tensor([ids])).logits[0, -1].float()
        return out, theirs
    (long, short), theirs = on_thread(run)
    assert int(long.argmax()) == int(theirs.argmax())
    gap = float((long - theirs).abs().max())
    assert gap < 2e-2 * float(theirs.abs().max())
    assert float((short - theirs).abs().max()) > 2 * gap
