"""Thinking models: the thinking split from the answer as it streams (chat/engine/events.py), in every
awkward split; the template's rule for what the model sees of earlier thinking; the local engine's slot."""
from __future__ import annotations

import random

import pytest

from chat.engine.events import Splitter, opens, thinks


def run(pieces, inside=False):
    """(thinking, answer, the pieces' outputs) of ``pieces`` pushed one by one, then flushed."""
    s = Splitter(inside)
    outs = [s.push(p) for p in pieces] + [s.flush()]
    return "".join(o[0] for o in outs), "".join(o[1] for o in outs), outs


def splits(text, rng, count=60):
    """``text`` cut at every single position, char by char, and at random places."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


CASES = [
    # (output, prompt opened <think>, thinking, answer)
    ("<think>\nLet me see. 2+2 is 4.\n</think>\n\nIt is **4**.", False, "Let me see. 2+2 is 4.", "It is **4**."),
    ("<think>\n\n</think>\n\nHi there!", False, "", "Hi there!"),  # Qwen3 with /no_think: empty thinking
    ("Okay, the user asks.\n</think>\n\nParis.", True, "Okay, the user asks.", "Paris."),  # R1: prompt opened it
    ("<think>\nrepeat of the tag\n</think>\nAnswer", True, "repeat of the tag", "Answer"),
    ("Just an answer, <think> in the middle stays.", False, "", "Just an answer, <think> in the middle stays."),
    ("  leading blanks and <b>html</b>", False, "", "  leading blanks and <b>html</b>"),
    ("<think>\nCut short while thin", False, "Cut short while thin", ""),  # no close tag: all thinking
    ("<think>\nhalf a tag at the end </thi", False, "half a tag at the end </thi", ""),
    ("<thi", False, "", "<thi"),  # an answer that merely begins like the tag
    ("<think>a < b and </thinker> is not the tag</think>ok", False, "a < b and </thinker> is not the tag", "ok"),
    ("<think>\n思考中……🙂\n</think>\n\n答案：是。", False, "思考中……🙂", "答案：是。"),
]


@pytest.mark.parametrize("output,inside,thought,answer", CASES)
def test_every_split_gives_the_same_thinking_and_answer(output, inside, thought, answer):
    rng = random.Random(output)
    for pieces in splits(output, rng):
        got_thought, got_answer, _ = run(pieces, inside)
        assert (got_thought, got_answer) == (thought, answer), pieces


def test_thinking_streams_as_it_comes_and_a_tag_is_held_only_while_it_may_be_one():
    _, _, outs = run(["<think>", "\nStep one", ". Step", " two\n", "</", "think>", "\n\n", "Done", "."])
    assert outs == [("", ""), ("Step one", ""), (". Step", ""), (" two", ""), ("", ""), ("", ""), ("", ""),
                    ("", "Done"), ("", "."), ("", "")]


def test_an_answer_without_thinking_is_untouched_piece_by_piece():
    pieces = ["Hello", ", wor", "ld <think>", "</think>"]
    _, _, outs = run(pieces)
    assert [o[1] for o in outs[:-1]] == pieces and all(not o[0] for o in outs)


def test_which_templates_think_and_which_prompts_open_the_thinking():
    assert thinks("{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert thinks("{{ '<｜Assistant｜><think>\\n' }}")
    assert not thinks("{{ '<|im_start|>assistant\\n' }}") and not thinks(None)
    assert opens("<｜Assistant｜><think>\n")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not opens("<|im_start|>assistant\n")


# ---------------------------------------------------------------- the template: Qwen3's rule, and R1's open tag

TEMPLATES = __import__("pathlib").Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="module")
def qwen3_file():
    from tinygguf import tiny_gguf
    return tiny_gguf(template=(TEMPLATES / "qwen3.jinja").read_text())


@pytest.fixture(scope="module")
def r1_file():
    from tinygguf import tiny_gguf
    return tiny_gguf(template=(TEMPLATES / "r1.jinja").read_text())


@pytest.fixture(scope="module")
def qwen3(qwen3_file):
    from chat.engine.model import loader
    return loader.gguf_tokenizer(qwen3_file)


HISTORY = [{"role": "system", "content": "You are terse."},
           {"role": "user", "content": "What is 2+2?"},
           {"role": "assistant", "content": "It is 4.",
            "reasoning_content": "Adding two and two<|im_start|> gives four."},
           {"role": "user", "content": "And 3+3?"}]


def test_qwen3s_template_drops_earlier_thinking_from_the_prompt(qwen3):
    from chat.engine.core import prompt
    assert thinks(qwen3.chat_template)
    text = qwen3.decode(prompt.render(qwen3, HISTORY))
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\nIt is 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # as transformers renders it for the same messages (the thinking in reasoning_content, as the template reads it)
    assert text == qwen3.apply_chat_template(HISTORY, tokenize=False, add_generation_prompt=True)


def test_enable_thinking_false_goes_to_the_template_and_the_answer_starts_outside_thinking(qwen3):
    from chat.engine import GenParams
    from chat.engine.core import prompt
    off = GenParams(enable_thinking=False)
    ids = prompt.request_ids(qwen3, HISTORY, off, 4096, 512)
    assert qwen3.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt.splitter(qwen3, HISTORY, off).thinking
    on = prompt.splitter(qwen3, HISTORY, GenParams())
    assert on is not None and not on.thinking  # Qwen3 writes its own <think>
    assert prompt.splitter(qwen3, HISTORY, GenParams(raw_prompt=True)) is None
    assert prompt.splitter(qwen3, HISTORY, GenParams(grammar="start: /[a-z]+/")) is None


def test_a_continued_answer_shows_its_own_thinking_to_the_model_and_its_text_stays_text(qwen3):
    from chat.engine.core import prompt
    cut = [*HISTORY[:2], {"role": "assistant", "content": "It is", "reasoning_content": "Two <|im_end|> two.",
                           "prefix": True}]
    ids = prompt.render(qwen3, cut)
    text = qwen3.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
                         "Two <|im_end|> two.\n</think>\n\nIt is")
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(end) == 2  # the system's and the question's: the one in the thinking is text
    assert prompt.splitter(qwen3, cut, __import__("chat.engine", fromlist=["GenParams"]).GenParams()) is None


def test_a_template_that_opens_think_in_the_prompt_starts_the_answer_inside_thinking(r1_file):
    from chat.engine import GenParams
    from chat.engine.core import prompt
    from chat.engine.model import loader
    r1 = loader.gguf_tokenizer(r1_file)
    assert qwen3_ends(r1.decode(prompt.render(r1, HISTORY)))
    split = prompt.splitter(r1, HISTORY, GenParams())
    assert split is not None and split.thinking


def qwen3_ends(text: str) -> bool:
    return text.endswith("<|im_start|>assistant\n<think>\n")


def test_a_slot_splits_a_thinking_models_tokens_one_by_one(qwen3):
    from chat.config import Settings
    from chat.engine import GenParams, Generation
    from chat.engine.core import prompt
    from chat.engine.core.slot import Slot
    slot = Slot(Generation(messages=HISTORY, params=GenParams()), [1], qwen3, Settings.from_env({}))
    out = "<think>\nSix, since 3+3 is 6.\n</think>\n\nIt is 6. 🙂"
    deltas = []
    for token in prompt.text_ids(qwen3, out):
        text, _ = slot.take(token, frozenset())
        deltas.append(slot.delta(text))
    deltas.append(slot.delta(slot.flush(), last=True))
    deltas = [d for d in deltas if d is not None]
    assert "".join(d.reasoning for d in deltas) == "Six, since 3+3 is 6."
    assert "".join(d.text for d in deltas) == "It is 6. 🙂"
    assert not any(d.reasoning and d.text for d in deltas)  # a token is thinking or answer
    plain = Slot(Generation(messages=HISTORY, params=GenParams()), [1], prompt_tokenizer_without_thinking(),
                 Settings.from_env({}))
    assert plain.thinking is None


def prompt_tokenizer_without_thinking():
    from chat.engine.model import loader
    from tinygguf import tiny_gguf
    return loader.gguf_tokenizer(tiny_gguf())


def test_the_local_engine_answers_inside_the_thinking_a_template_opened(r1_file, tmp_path):
    """The tiny random model never writes </think>: cut by its budget, its whole answer is thinking, kept."""
    from chat.engine import Delta, GenParams
    from helpers import make_engine
    engine = make_engine(r1_file, tmp_path, max_new_tokens=64)
    try:
        assert engine.thinks() and engine.describe()["thinking"] is True  # /readyz and ready.thinking say so
        events = list(engine.submit(HISTORY, GenParams(temperature=0, max_new_tokens=12)))
        deltas = [e for e in events if isinstance(e, Delta)]
        thought = "".join(d.reasoning for d in deltas)
        assert thought and thought == thought.strip() and not "".join(d.text for d in deltas)
        assert events[-1].reason == "length" and events[-1].usage["completion_tokens"] == 12
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- the store: SQLite and PostgreSQL

def test_the_store_keeps_thinking_with_the_answer_through_export_import_and_branch(store):
    import json

    from helpers import ALICE
    conv = store.create_conversation(ALICE)
    store.add_user_message(ALICE, conv["id"], "2+2?")
    mid = store.start_assistant(conv["id"])
    store.save_partial(mid, "", "Two and")  # a checkpoint while it still thinks
    assert store.get_conversation(ALICE, conv["id"])["messages"][1]["reasoning"] == "Two and"
    store.finish_assistant(mid, "4.", "stop", {"completion_tokens": 9}, {"thinking_ms": 120.5}, "Two and two.")
    answer = store.get_conversation(ALICE, conv["id"])["messages"][1]
    assert (answer["content"], answer["reasoning"], answer["timings"]["thinking_ms"]) == ("4.", "Two and two.", 120.5)
    assert store.history(conv["id"])[-1] == {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."}
    assert "reasoning" not in store.get_conversation(ALICE, conv["id"])["messages"][0]  # only where there is some
    body = json.loads(store.export(ALICE, conv["id"], "json")[0])
    copy = store.import_conversation(ALICE, body, 10_000)
    assert store.get_conversation(ALICE, copy)["messages"][1]["reasoning"] == "Two and two."
    branch = store.branch(ALICE, conv["id"], mid, 10_000)
    assert store.get_conversation(ALICE, branch)["messages"][1]["reasoning"] == "Two and two."
    assert "> **Thinking:**\n> Two and two.\n\n4." in store.export(ALICE, conv["id"], "md")[0]


@pytest.mark.parametrize("body,expected", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"chat_template_kwargs": {"enable_thinking": True, "other": 1}}, True),  # other keys ignored
    ({"enable_thinking": False}, False),  # top level, as Qwen's cloud API takes it
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, False),  # the kwargs win
    ({"chat_template_kwargs": {}}, None),
    ({}, None),
])
def test_v1_reads_the_switch_as_vllm_and_qwen_send_it(body, expected):
    from chat.config import Settings
    from chat.web.openai_api import gen_params, parse_request
    values = parse_request({"messages": [{"role": "user", "content": "hi"}], **body}, Settings())
    assert gen_params(values).get("enable_thinking") == expected


@pytest.mark.parametrize("body,field", [
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": [True]}, "chat_template_kwargs"),
    ({"enable_thinking": 0}, "enable_thinking"),
])
def test_v1_refuses_a_switch_that_is_not_a_boolean(body, field):
    from chat.config import Settings
    from chat.errors import RequestError
    from chat.web.openai_api import parse_request
    with pytest.raises(RequestError) as err:
        parse_request({"messages": [{"role": "user", "content": "hi"}], **body}, Settings())
    assert err.value.status == 400 and f"'{field}'" in err.value.message


def test_v1_sends_thinking_and_answer_in_chunks_of_their_own_through_the_sdk(app_factory):
    """The in-process app and the fake engine thinking in awkward pieces (one piece ends the thinking and
    starts the answer): the OpenAI SDK reads reasoning_content whole and streamed."""
    openai = pytest.importorskip("openai")
    from fakes import FakeEngine
    words = ["<thi", "nk>\nSmall", " numbers.\n</think>\n\nYes", ", 2 < 3."]
    srv = app_factory(FakeEngine(words=words, thinking=True))
    sdk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
    ask = [{"role": "user", "content": "2 < 3?"}]
    whole = sdk.chat.completions.create(model="m", messages=ask).choices[0].message
    assert (whole.reasoning_content, whole.content) == ("Small numbers.", "Yes, 2 < 3.")  # type: ignore[attr-defined]
    chunks = [c.choices[0].delta for c in sdk.chat.completions.create(model="m", messages=ask, stream=True)
              if c.choices]
    thinking = [getattr(d, "reasoning_content", None) or "" for d in chunks]
    assert "".join(thinking) == "Small numbers." and "".join(d.content or "" for d in chunks) == "Yes, 2 < 3."
    assert not any(t and d.content for t, d in zip(thinking, chunks))


def test_the_cli_dims_thinking_on_a_terminal_and_hides_it_when_asked(monkeypatch):
    import io

    from chat.client import cli

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for hide, expected in ((False, "\033[2mThinking…\nSmall numbers.\n…done thinking.\033[0m\n\nYes.\n"),
                           (True, "Yes.\n")):
        out = Terminal()
        monkeypatch.setattr("sys.stdout", out)
        printer = cli._Printer(raw=False, hide_thinking=hide)
        for piece in ("Small", " numbers."):
            printer.thought(piece)
        printer.text("Yes.")
        printer.end()
        assert out.getvalue() == expected
