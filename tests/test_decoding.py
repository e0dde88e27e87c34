"""Incremental decoding with the bundled tokenizer, stop sequences, prompt fitting."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from chat.engine.core import prompt
from chat.engine.core.decoding import IncrementalDecoder, StopMatcher
from chat.errors import PromptTooLong

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷🇯🇵, accents: café, naïve, Ångström.",
    "日本語のテキストと한국어 텍스트, mixed with code: `x = [i**2 for i in range(10)]`",
    "  leading spaces\n\nand   multiple\tspaces\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas), deltas


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji across tokens
    decoder = IncrementalDecoder(tokenizer)
    out = [decoder.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


@pytest.mark.parametrize("text", ["Paris 😀", "你好世界", "naïve café 🇫🇷"])
def test_an_answer_cut_inside_a_character_ends_without_a_replacement_char(tokenizer, text):
    """max_new_tokens can end an answer between the tokens of one character: its first bytes are dropped."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = IncrementalDecoder(tokenizer)
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "the text has no multi-byte character split across tokens"
    for n in cuts:
        decoder = IncrementalDecoder(tokenizer)
        answer = "".join([decoder.push(i) for i in ids[:n]] + [decoder.flush()])
        assert "\ufffd" not in answer and text.startswith(answer), (n, answer)
    assert "".join([full.push(i) for i in ids] + [full.flush()]) == text


@pytest.mark.parametrize("chunks,stops,expected,hit", [
    (["Hello ", "wor", "ld"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cd"], "ab", True),
    (["no stop ", "here"], ["STOP"], "no stop here", False),
    (["x<", "|en", "d|>tail"], ["<|end|>"], "x", True),
    (["abc"], [], "abc", False),
])
def test_stop_matcher(chunks, stops, expected, hit):
    matcher = StopMatcher(stops)
    out, stopped = "", False
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out += text
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert (out, stopped) == (expected, hit)


def test_fit_keeps_system_and_drops_oldest_turns(tokenizer):
    messages = [{"role": "system", "content": "SYSTEM-MARK"}]
    for i in range(20):
        messages += [{"role": "user", "content": f"question {i} " * 10},
                     {"role": "assistant", "content": f"answer {i} " * 10}]
    messages.append({"role": "user", "content": "LAST-QUESTION"})
    ids, dropped = prompt.fit(tokenizer, messages, 300)
    text = tokenizer.decode(ids)
    assert len(ids) <= 300 and dropped > 0
    assert "SYSTEM-MARK" in text and "LAST-QUESTION" in text and "question 0 " not in text
    assert text.rstrip().endswith("assistant")


def test_fit_refuses_a_message_that_cannot_fit(tokenizer):
    with pytest.raises(PromptTooLong) as err:
        prompt.fit(tokenizer, [{"role": "user", "content": "word " * 500}], 64)
    assert err.value.code == "too_large"


def conversation(turns: int, words: int) -> list:
    messages = [{"role": "system", "content": "SYSTEM-MARK"}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Q{i}-START " + f"question {i} " * words + f"Q{i}-END"},
                     {"role": "assistant", "content": f"A{i}-START " + f"answer {i} " * words + f"A{i}-END"}]
    return messages + [{"role": "user", "content": "LAST-QUESTION"}]


def test_fit_drops_whole_turns_and_keeps_the_newest(tokenizer):
    ids, dropped = prompt.fit(tokenizer, conversation(30, 12), 400)
    text = tokenizer.decode(ids)
    assert len(ids) <= 400 and dropped > 0 and dropped % 2 == 0  # whole user/assistant pairs
    kept = [i for i in range(30) if f"Q{i}-START" in text]
    assert kept == list(range(kept[0], 30))  # a contiguous run of the newest turns
    for i in kept:  # every kept turn is whole
        assert all(mark in text for mark in (f"Q{i}-START", f"Q{i}-END", f"A{i}-START", f"A{i}-END"))
    assert f"A{kept[0] - 1}-END" not in text  # nothing of the turn before
    assert "SYSTEM-MARK" in text and "LAST-QUESTION" in text
    # where the cut falls, and that it stays there turn after turn: test_history_cut.py
