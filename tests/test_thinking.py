"""Thinking models: the thinking split from the answer as it streams (chat/engine/thinking.py), in every
awkward split; the template's rule for what the model sees of earlier thinking; the local engine's slot."""
from __future__ import annotations

import random

import pytest

from chat.engine.thinking import Splitter, opens, thinks


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
