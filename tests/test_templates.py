"""A model without a chat template (a base model) starts and serves: raw prompts as they are, chat in ChatML
(CHAT_TEMPLATE's fallback), cut at the next marker it writes; CHAT_TEMPLATE names a built-in or a Jinja file in
place of a model's own; /readyz says which (issue 41, item 4)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from chat.config import Settings
from chat.engine import GenParams
from chat.engine.core import prompt
from chat.engine.model import loader, templates
from chat.errors import ConfigError
from helpers import ask, collect, http_get, make_engine
from test_quant import on_thread
from tinygguf import tiny_gguf


@pytest.fixture(scope="module")
def base_file():
    return tiny_gguf(template=False)


def test_a_base_model_loads_with_chatml_and_says_so(base_file, tmp_path):
    assert not loader.gguf_tokenizer(base_file).chat_template
    loaded = on_thread(lambda: loader.load(Settings.from_env({}, model=str(base_file), data_dir=str(tmp_path))))
    assert loaded.template == templates.Template("chatml", True, ("<|im_end|>", "<|im_start|>"))
    text = loaded.tokenizer.decode(prompt.render(loaded.tokenizer, ask("Hi there")))
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_a_base_model_serves_raw_prompts_and_chat_and_ends_at_a_marker(base_file, tmp_path):
    engine = make_engine(base_file, tmp_path, max_new_tokens=64)
    try:
        facts = engine.describe()
        assert facts["template"] == "chatml" and facts["base_model"] is True
        raw, events = collect(engine.submit([{"role": "user", "content": "Once upon a time"}],
                                            GenParams(temperature=0, max_new_tokens=12, raw_prompt=True)))
        assert raw and events[-1].usage["prompt_tokens"] == len(loader.gguf_tokenizer(base_file).encode(
            "Once upon a time"))
        chat, events = collect(engine.submit(ask("Hi there"), GenParams(temperature=0, max_new_tokens=12)))
        assert chat and events[-1].reason in ("length", "stop")
        # the template's markers end a chat answer (the tiny random model never writes one: say it does)
        assert engine.queue.stops == ("<|im_end|>", "<|im_start|>")
    finally:
        engine.shutdown()


def test_a_slot_of_a_base_model_stops_at_the_marker_but_a_raw_prompt_does_not(base_file):
    from chat.engine.core.slot import Slot
    from chat.engine.base import Generation
    tokenizer = loader.gguf_tokenizer(base_file)
    settings = Settings.from_env({})
    stops = templates.BUILT_IN["chatml"][1]
    marker = prompt.text_ids(tokenizer, "Fine.<|im_end|>\nmore")  # the marker written as text
    for raw, expected in ((False, ("Fine.", "stop")), (True, ("Fine.<|im_end|>\nmore", None))):
        slot = Slot(Generation(messages=[], params=GenParams(raw_prompt=raw)), [1], tokenizer, settings, stops)
        text, reason = "", None
        for token in marker:
            piece, reason = slot.take(token, frozenset())
            text += piece
            if reason:
                break
        text += slot.flush() if not reason else ""
        assert (text, reason) == expected


def test_chat_template_names_a_built_in_or_a_file_and_a_bad_one_is_refused(tmp_path):
    tokenizer = loader.gguf_tokenizer(tiny_gguf())
    own = tokenizer.chat_template
    assert templates.choose(tokenizer, "auto") == templates.Template("model", False)
    assert tokenizer.chat_template == own
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}[assistant] {% endif %}")
    chosen = templates.choose(tokenizer, str(jinja))
    assert chosen.name == f"file {jinja}" and not chosen.base_model
    assert tokenizer.decode(prompt.render(tokenizer, [{"role": "user", "content": "Hi"}])) == "[user] Hi\n[assistant] "
    assert templates.choose(tokenizer, "chatml").name == "chatml"
    for bad in (str(tmp_path / "missing.jinja"), "chatgpt"):
        with pytest.raises(ConfigError, match="CHAT_TEMPLATE"):
            templates.choose(tokenizer, bad)


@pytest.mark.slow
def test_a_live_server_on_a_base_model_is_ready_and_answers_completions(base_file, server_factory):
    srv = server_factory("base", CHAT_MODEL=str(base_file))
    status, _, body = http_get(srv.url + "/readyz")
    ready = json.loads(body)
    assert status == 200 and ready["base_model"] is True and ready["template"] == "chatml"
    request = urllib.request.Request(srv.url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"prompt": "Once upon a time", "max_tokens": 8,
                                                               "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] > 0
