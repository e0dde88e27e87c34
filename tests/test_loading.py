"""What loading says while it runs: a GGUF the own decoder does not read converted once, in bfloat16, with its
progress on /readyz; the start-up line's path and measured speed."""
from __future__ import annotations

import json
import logging
import struct

import pytest
from fakes import FakeEngine
from helpers import http_get, make_engine


def _safetensors_dtypes(folder) -> set[str]:
    """The dtypes a saved model's safetensors files declare in their headers."""
    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        dtypes |= {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return dtypes


@pytest.mark.slow
def test_a_gguf_for_transformers_is_converted_once_in_bfloat16_with_its_progress(tmp_path, caplog):
    """transformers' forward runs what the own decoder does not: the GGUF is de-quantized tensor by tensor
    into bfloat16 (never a float32 copy), progress reported per tensor, and a second start converts nothing."""
    from pathlib import Path

    from chat.engine.model import loader
    told = []
    with caplog.at_level(logging.INFO, logger="chat.engine.model.loader"):
        path, name = loader.resolve_source(str(loader.bundled_gguf()), str(tmp_path),
                                           lambda step, done, total: told.append((step, done, total)))
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    assert told and all(step.startswith("converting SmolLM2-135M-Instruct") for step, _, _ in told)
    totals = {total for _, _, total in told}
    done = [d for _, d, _ in told]
    assert len(totals) == 1 and totals.pop() > 100  # one call per tensor of the file
    assert done == sorted(done) and done[0] == 0 and done[-1] == told[-1][2]
    assert "converted SmolLM2-135M-Instruct.Q4_1.gguf" in caplog.text
    assert _safetensors_dtypes(Path(path)) == {"BF16"}
    again = []
    assert loader.resolve_source(str(loader.bundled_gguf()), str(tmp_path),
                                 lambda *a: again.append(a)) == (path, name)
    assert again == []


def test_readyz_shows_how_far_a_long_load_step_is(app_factory):
    engine = FakeEngine(ready=False)
    srv = app_factory(engine)
    assert json.loads(http_get(srv.url + "/readyz")[2]) == {"status": "loading"}
    engine.loading = {"step": "converting x.gguf", "done": 12, "total": 290}
    status, _, body = http_get(srv.url + "/readyz")
    assert status == 503
    assert json.loads(body) == {"status": "loading", "progress": {"step": "converting x.gguf", "done": 12,
                                                                  "total": 290}}


def test_the_start_up_line_says_which_path_runs_and_its_measured_speed(tiny_model, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="chat.engine.core.local"):
        engine = make_engine(tiny_model, tmp_path, warmup=True)
        engine.shutdown()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready:"))
    assert " on the own decoder, a decode step " in line and " tokens/s one answer" in line, line
    assert engine.step_s > 0


@pytest.mark.parametrize("template", ["bundled", "qwen3.jinja"])
def test_a_gguf_tokenizer_kept_once_converted_is_the_same_tokenizer(tmp_path, template):
    """A GGUF's tokenizer is kept in the model cache once converted (its metadata read string by string costs
    seconds of a 262k vocabulary's start): the kept one encodes, decodes and templates as the file's does, and
    a second start reads it, not the file."""
    from pathlib import Path

    from tinygguf import tiny_gguf

    from chat.engine.model import loader
    path = tiny_gguf(template=(Path(__file__).parent / "templates" / template).read_text()
                     if template != "bundled" else True)
    first = loader.gguf_tokenizer(path, str(tmp_path))
    kept = [p for p in tmp_path.iterdir() if p.name.endswith("-tokenizer")]
    assert len(kept) == 1 and (kept[0] / "tokenizer.json").is_file()
    second = loader.gguf_tokenizer(path, str(tmp_path))
    assert second.name_or_path == str(kept[0])  # read from the cache, not the file
    text = "Hello <|im_start|> world, ünïcode 🙂\n\n  spaces <think>x</think>"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    assert first.encode(text) == second.encode(text)
    assert second.decode(first.encode(text)) == first.decode(first.encode(text))
    assert (first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert ([first.eos_token_id, first.bos_token_id, first.pad_token_id, len(first), first.all_special_tokens]
            == [second.eos_token_id, second.bos_token_id, second.pad_token_id, len(second), second.all_special_tokens])
