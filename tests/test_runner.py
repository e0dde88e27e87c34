"""The model runner's second implementation: transformers' forward, for an architecture the own decoder
does not run (Phi), in the same batching engine: greedy answers equal ``generate``'s, alone and batched."""
from __future__ import annotations

import pytest
from helpers import QUESTIONS, ask, collect, make_engine
from tinymodel import tiny_phi_dir

from chat.engine import GenParams
from chat.engine.model.runner import DecoderRunner, ModelRunner, TransformersRunner


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = make_engine(tiny_phi_dir(), tmp_path_factory.mktemp("phi"))
    yield eng
    eng.shutdown()


def test_an_architecture_the_own_decoder_does_not_run_gets_transformers_forward(engine):
    assert isinstance(engine.runner, TransformersRunner) and engine.decoder is None
    assert engine.loaded.model.config.model_type == "phi"
    assert engine.stats()["decode"] == "torch" and engine.describe()["weights"] == "float32"


def test_greedy_equals_transformers_generate(engine):
    import torch

    from chat.engine.core import prompt
    for question in QUESTIONS[:2]:
        messages = ask(question)
        text, events = collect(engine.submit(messages, GenParams(temperature=0, max_new_tokens=24)))
        loaded = engine.loaded
        ids = prompt.render(loaded.tokenizer, messages)
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                        max_new_tokens=24, do_sample=False, eos_token_id=sorted(loaded.eos_ids),
                                        pad_token_id=loaded.tokenizer.eos_token_id)
        new = out[0, len(ids):].tolist()
        while new and new[-1] in loaded.eos_ids:
            new.pop()
        assert events[-1].usage["completion_tokens"] == len(new)
        assert text == loaded.tokenizer.decode(new, skip_special_tokens=True)


def test_batched_greedy_equals_alone(engine):
    """Left-padded rows of different lengths, decode attention split by runs of rows: each its solo answer."""
    greedy = GenParams(temperature=0, max_new_tokens=24)
    alone = [collect(engine.submit(ask(q * (i + 1)), greedy))[0] for i, q in enumerate(QUESTIONS)]
    gens = [engine.submit(ask(q * (i + 1)), greedy) for i, q in enumerate(QUESTIONS)]
    assert [collect(g)[0] for g in gens] == alone


def test_both_runners_have_what_the_protocol_declares(engine, tiny_model, tmp_path):
    """Each implementation answers every member the protocol declares (mypy checks the types: runner_for)."""
    own = make_engine(tiny_model, tmp_path)
    try:
        assert isinstance(own.runner, DecoderRunner) and own.decoder is not None
        members = [m for m in vars(ModelRunner) if not m.startswith("_")] + list(ModelRunner.__annotations__)
        for runner in (own.runner, engine.runner):
            assert [m for m in members if not hasattr(runner, m)] == [], type(runner).__name__
        assert own.runner.dims[:3] == engine.runner.dims[:3] == (2, 2, 16)
    finally:
        own.shutdown()
