"""Where a long conversation's history is cut (prompt.fit): a start that stays put across turns until the
context overflows, so the next turns' prompts extend the previous one and reuse its KV."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import collect, make_engine
from transformers import AutoTokenizer

from chat.engine import GenParams
from chat.engine.core import prompt
from chat.errors import PromptTooLong

BUDGET = 600
SYSTEM = {"role": "system", "content": "SYSTEM-MARK"}
TEMPLATES = Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def question(i: int) -> dict:
    """The i-th question: lengths vary from turn to turn."""
    return {"role": "user", "content": f"Q{i}-START " + f"question {i} " * (3 + 7 * i % 13) + f"Q{i}-END"}


def answer(i: int) -> dict:
    return {"role": "assistant", "content": f"A{i}-START " + f"answer {i} " * (2 + 5 * i % 11) + f"A{i}-END"}


def talk(tokenizer, turns: int, budget: int = BUDGET) -> list:
    """Each request of a conversation of ``turns`` questions, as a client sends them (the history so far,
    the answers included): (messages, prompt ids, messages dropped)."""
    messages, requests = [SYSTEM], []
    for i in range(turns):
        messages = messages + [question(i)]
        ids, dropped = prompt.fit(tokenizer, messages, budget)
        requests.append((messages, ids, dropped))
        messages = messages + [answer(i)]
    return requests


def test_the_cut_stays_put_until_the_context_overflows(tokenizer):
    requests = talk(tokenizer, 40)
    base, _ = prompt._overheads(tokenizer, [SYSTEM])
    target = int((BUDGET - base) * prompt.CUT_TO)
    moves = stays = 0
    for k in range(1, len(requests)):
        (before, old, cut), (messages, ids, dropped) = requests[k - 1], requests[k]
        turns = messages[1:]
        if dropped == cut:
            stays += cut > 0
            # the previous prompt and its answer, then the new question: a prefix-cache hit
            said = prompt.text_ids(tokenizer, turns[len(before) - 1]["content"])
            assert ids[:len(old) + len(said)] == old + said, k
            continue
        moves += 1
        assert dropped > cut  # the cut only moves forward...
        assert len(prompt.render(tokenizer, [SYSTEM] + turns[cut:])) > BUDGET, k  # ...when the old one overflows
        # ...to the first turn start that brings the kept part to half the room
        assert len(ids) - base <= target, k
        earlier = max(i for i in range(cut, dropped) if turns[i]["role"] == "user")
        assert len(prompt.render(tokenizer, [SYSTEM] + turns[earlier:])) - base > target, k
    assert moves >= 3 and stays >= 3 * moves, (moves, stays)


def test_every_cut_prompt_keeps_system_newest_turn_and_whole_turns(tokenizer):
    for messages, ids, dropped in talk(tokenizer, 40):
        turns = messages[1:]
        text = tokenizer.decode(ids)
        assert len(ids) <= BUDGET
        assert turns[dropped]["role"] == "user"  # the prompt starts at a question
        assert ids == prompt.render(tokenizer, [SYSTEM] + turns[dropped:])
        assert "SYSTEM-MARK" in text and turns[-1]["content"] in text
        n = len(turns) // 2
        kept = [i for i in range(n + 1) if f"Q{i}-START" in text]
        assert kept == list(range(dropped // 2, n + 1))  # a contiguous run of the newest turns, each whole
        assert all(f"A{i}-END" in text for i in kept[:-1]) and f"A{kept[0] - 1}-END" not in text


def test_the_cut_depends_on_the_history_alone(tokenizer):
    """A restarted server, another worker: the same history, counted afresh, is cut at the same place."""
    messages, ids, dropped = talk(tokenizer, 30)[-1]
    prompt._COUNTS.clear()
    assert prompt.fit(tokenizer, messages, BUDGET) == (ids, dropped)
    assert prompt.fit(tokenizer, messages, BUDGET) == (ids, dropped)  # and from the remembered counts


def test_tool_calls_count_so_the_cut_still_stays_put(tiny_model):
    """A template that writes tool calls out (Qwen3's): their arguments count, else the kept part is
    estimated low, passes the budget when rendered and the cut walks a turn a request as before."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    messages, requests, budget = [SYSTEM], [], 2 * BUDGET  # a turn here is about 200 tokens
    for i in range(40):
        messages = messages + [question(i)]
        requests.append((messages, *prompt.fit(tokenizer, messages, budget)))
        arguments = json.dumps({"city": f"city {i}", "notes": f"note {i} " * (4 + i % 9)})
        messages = messages + [
            {"role": "assistant", "tool_calls": [{"id": f"call_{i}", "type": "function",
                                                  "function": {"name": "weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"sunny in city {i}"}, answer(i)]
    moves = stays = 0
    for (_, old, cut), (_, ids, dropped) in zip(requests, requests[1:]):
        assert len(ids) <= budget
        if dropped == cut:
            stays += cut > 0
            assert ids[:len(old)] == old
        else:
            moves += 1
            assert len(ids) <= budget * 0.6  # cut to about half at once, not by one turn
    assert moves >= 3 and stays >= 2 * moves, (moves, stays)


def test_a_long_newest_turn_is_kept_alone_and_one_too_long_refused(tokenizer):
    messages = talk(tokenizer, 12)[-1][0] + [answer(11)]
    big = {"role": "user", "content": "BIG-START " + "word " * (BUDGET * 2 // 3) + "BIG-END"}  # over half the budget
    ids, dropped = prompt.fit(tokenizer, messages + [big], BUDGET)
    assert dropped == len(messages) - 1 and len(ids) <= BUDGET
    assert tokenizer.decode(ids).count("-START") == 1 and "SYSTEM-MARK" in tokenizer.decode(ids)
    with pytest.raises(PromptTooLong):
        prompt.fit(tokenizer, messages + [{"role": "user", "content": "word " * BUDGET}], BUDGET)


def test_a_history_that_opens_with_an_answer_is_cut_at_a_question(tokenizer):
    messages = [SYSTEM, {"role": "assistant", "content": "Hello! Ask me anything."}, question(0)]
    ids, dropped = prompt.fit(tokenizer, messages, BUDGET)
    assert dropped == 1 and "Hello!" not in tokenizer.decode(ids)


def test_a_long_history_is_counted_once(tokenizer, monkeypatch):
    """Linear: the first request counts each message once; the next tokenizes only its new messages and
    what it keeps."""
    seen = []
    encode = tokenizer.encode

    def counting(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    messages = [SYSTEM]
    for i in range(100):
        messages += [{"role": "user", "content": f"question {i} " * 400},
                     {"role": "assistant", "content": f"answer {i} " * 400}]
    history = sum(len(m["content"]) for m in messages)  # about 0.9 MB
    prompt.fit(tokenizer, messages + [{"role": "user", "content": "LAST"}], 1500)
    assert sum(seen) < history * 1.05  # each message once, and the kept part rendered
    seen.clear()
    ids, dropped = prompt.fit(tokenizer, messages + [{"role": "user", "content": "LAST"},
                                                      {"role": "assistant", "content": "ok"},
                                                      {"role": "user", "content": "NEXT"}], 1500)
    assert len(ids) <= 1500 and dropped > 190
    assert sum(seen) < 40_000  # a few messages' worth of characters, not the whole history


def test_the_turns_after_a_cut_reuse_the_cached_kv(tiny_model, tmp_path):
    """Through the real engine, at a small context: once the history is cut, each next turn reuses the
    previous prompt's KV (the conversation's own prefix-cache entry) until the cut moves again."""
    eng = make_engine(tiny_model, tmp_path, context_tokens=384)
    params = GenParams(temperature=0, max_new_tokens=16)
    budget = 384 - 16
    try:
        tok = eng.loaded.tokenizer
        messages, turns = [SYSTEM], []
        for i in range(16):
            messages = messages + [question(i)]
            text, events = collect(eng.submit(messages, params, key="conv-cut"))
            done = events[-1]
            ids, dropped = prompt.fit(tok, messages, budget)
            assert done.usage["prompt_tokens"] == len(ids)
            turns.append((dropped, len(ids), done.reused_tokens))
            messages = messages + [{"role": "assistant", "content": text}]
    finally:
        eng.shutdown()
    kept = 0
    for (cut, before, _), (dropped, _, reused) in zip(turns, turns[1:]):
        if dropped == cut:
            assert reused >= before, turns  # the whole previous prompt came from the cache
            kept += cut > 0
    assert sum(a[0] != b[0] for a, b in zip(turns, turns[1:])) >= 2, turns  # the history was cut, twice
    assert kept >= 4, turns  # and turns past the context's end reused the cache
