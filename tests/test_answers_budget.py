"""Constrained answers that end well within max_tokens (chat/engine/budget.py), and tool calls as
OpenAI specifies them: one call unless parallel calls are asked for, a named choice one call of that
function, a repeated call dropped, streamed arguments exactly the JSON, ids alike streamed and whole.
The tiny random model is the worst case: left alone it never closes a value."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from fakes import AppServer
from helpers import NAMED_WEATHER as NAMED
from helpers import TIME_TOOL as TIME
from helpers import WEATHER_TOOL as WEATHER
from helpers import make_app, make_engine

openai = pytest.importorskip("openai")

PAIR = {"type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}},
        "required": ["name", "color"], "additionalProperties": False}
NESTED = {"type": "object", "required": ["id", "items"], "additionalProperties": False, "properties": {
    "id": {"type": "integer"},
    "items": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["product", "quantity"], "additionalProperties": False,
        "properties": {"product": {"type": "string"}, "quantity": {"type": "number"}}}}}}
FRUITS = [{"role": "user", "content": "List two fruits as JSON."}]


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("budget"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sdk(engine):
    server = AppServer(make_app(engine, max_new_tokens=512))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.close()


# ---- the budget

@pytest.mark.parametrize("max_tokens", [12, 25, 40, 80])
@pytest.mark.parametrize("fmt, schema", [({"type": "json_object"}, {"type": "object"}),
                                         (_format(PAIR), PAIR), (_format(NESTED), NESTED)])
def test_constrained_answers_always_parse_within_max_tokens(sdk, fmt, schema, max_tokens):
    if schema is NESTED and max_tokens < 21:  # its shortest value is 21 tokens
        max_tokens = 21
    reasons = set()
    for seed in range(4):
        out = sdk.chat.completions.create(model="m", messages=FRUITS, response_format=fmt, max_tokens=max_tokens,
                                          temperature=1.0, seed=seed)
        choice = out.choices[0]
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert out.usage.completion_tokens <= max_tokens
        reasons.add(choice.finish_reason)
    assert reasons <= {"stop", "length"}


def test_a_forced_close_says_length(sdk):
    """A random model at temperature 1.5 fills its budget; the close the budget forced says ``length``."""
    forced = 0
    for seed in range(6):
        out = sdk.chat.completions.create(model="m", messages=FRUITS, response_format={"type": "json_object"},
                                          max_tokens=30, temperature=1.5, seed=seed)
        json.loads(out.choices[0].message.content)
        if out.choices[0].finish_reason == "length":
            forced += 1
            assert out.usage.completion_tokens <= 30
    assert forced >= 1


def test_streamed_close_equals_the_whole(sdk):
    kwargs = dict(model="m", messages=FRUITS, response_format=_format(NESTED), max_tokens=30, temperature=1.0,
                  seed=3)
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    jsonschema.validate(json.loads(whole.message.content), NESTED)


def test_the_close_can_be_switched_off(tiny_model, tmp_path):
    from chat import structured
    from chat.engine import GenParams
    from helpers import ask, collect
    eng = make_engine(tiny_model, tmp_path, grammar_close=False)
    try:
        grammar = structured.response_format({"type": "json_object"})
        texts = [collect(eng.submit(ask("JSON"), GenParams(temperature=1.5, seed=s, max_new_tokens=12,
                                                           grammar=grammar)))[0] for s in range(6)]
    finally:
        eng.shutdown()

    def parses(text):
        try:
            json.loads(text)
            return True
        except ValueError:
            return False
    assert not all(parses(t) for t in texts)  # cut mid-value, as before the budget


# ---- the runaway guards, on the bundled tokenizer and llguidance alone

@pytest.fixture(scope="module")
def grammars():
    from chat.engine.core.grammar import Grammars
    from chat.engine.model.loader import bundled_gguf, gguf_tokenizer
    tok = gguf_tokenizer(bundled_gguf())
    return Grammars(tok, frozenset([tok.eos_token_id]), len(tok))


def _guard(grammars, text, max_new=500, **settings):
    from chat import structured
    from chat.config import Settings
    from chat.engine.core.budget import Guard
    matcher = grammars.matcher(structured.response_format({"type": "json_object"}))
    guard = Guard(grammars.table, matcher, max_new, Settings(**settings), calls=False)
    for t in grammars.hf.encode(text, add_special_tokens=False):
        assert matcher.consume_token(t)
        guard.took(t)
    return matcher, guard


def _allowed(grammars, matcher, guard) -> set[bytes]:
    bits = np.zeros(grammars.table.words, dtype=np.uint32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    guard.restrict(bits)
    ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    return {grammars.table.bytes[i] for i in ids}


def test_a_number_stops_taking_digits(grammars):
    m, g = _guard(grammars, '{"a": 1, "b": 2018.0803222013132')
    assert _allowed(grammars, m, g) == {b",", b"}"}
    m, g = _guard(grammars, '{"a": 1, "b": 2018.0803222013132', json_max_digits=0)
    assert b"7" in _allowed(grammars, m, g)
    m, g = _guard(grammars, '{"a": 1, "b": 2018.08')  # under the cap: untouched
    assert b"7" in _allowed(grammars, m, g)


def test_a_key_is_never_written_twice(grammars):
    m, g = _guard(grammars, '{", ": 1, "b": {", ": 2}, ", ')
    allowed = _allowed(grammars, m, g)
    assert not any(t.startswith(b'"') for t in allowed) and b"x" in allowed  # ", " may not close; go on
    m, g = _guard(grammars, '{", ": 1, "b": {", ')
    assert b'"' in _allowed(grammars, m, g)  # another object: its own keys
    m, g = _guard(grammars, '{", ": 1, ", ', json_unique_keys=False)
    assert b'"' in _allowed(grammars, m, g)


def test_the_shortest_ending(grammars):
    tok = grammars.hf
    for text, ending in [('{"a": [1, {"b": "xy', '"}]}'), ('{"a": 12', "}"), ('{"a": tr', "ue}"), ("{", "}")]:
        _, g = _guard(grammars, text)
        assert tok.decode(g._ending(None)) == ending


# ---- tool calls

def _streamed(sdk, **kwargs):
    chunks = list(sdk.chat.completions.create(model="m", messages=FRUITS, stream=True, **kwargs))
    calls: dict = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            assert slot["id"] is None or d.id is None  # the id once, with the call's first delta
            slot["id"] = d.id or slot["id"]
            slot["name"] += (d.function.name or "") if d.function else ""
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
        assert not (c.choices and c.choices[0].delta.content and "<tool" in c.choices[0].delta.content)
    return chunks, calls


@pytest.mark.parametrize("choice", [NAMED, "required"])
@pytest.mark.parametrize("parallel", [None, False, True])
def test_named_and_required_give_one_call_unless_parallel(sdk, choice, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    for seed in range(3):
        chunks, calls = _streamed(sdk, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=1.0,
                                  seed=seed, **extra)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        if choice is NAMED or not parallel:
            assert list(calls) == [0]
        names = [calls[i]["name"] for i in sorted(calls)]
        if choice is NAMED:
            assert names == ["get_weather"]
        seen = set()
        for i in sorted(calls):
            args = json.loads(calls[i]["arguments"])  # exactly the JSON, no template text
            tool = WEATHER if calls[i]["name"] == "get_weather" else TIME
            jsonschema.validate(args, tool["function"]["parameters"])
            assert (calls[i]["name"], json.dumps(args)) not in seen  # never the same call twice
            seen.add((calls[i]["name"], json.dumps(args)))


def test_call_ids_are_the_same_streamed_and_whole(sdk):
    from chat.structured import call_id
    kwargs = dict(tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    whole = sdk.chat.completions.create(model="m", messages=FRUITS, **kwargs)
    assert whole.choices[0].message.tool_calls[0].id == call_id(whole.id, 0)
    chunks, calls = _streamed(sdk, **kwargs)
    assert calls[0]["id"] == call_id(chunks[0].id, 0)
    assert calls[0]["arguments"] == whole.choices[0].message.tool_calls[0].function.arguments


def test_tool_result_round_trip(sdk):
    first = sdk.chat.completions.create(model="m", messages=FRUITS, tools=[WEATHER], tool_choice=NAMED,
                                        max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = FRUITS + [first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    second = sdk.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=20, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


REPEATED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_repeated_call_is_dropped_streamed_and_whole(step):
    from chat import structured
    from chat.web.openai_tools import CallStream
    stream, out = CallStream("seed"), []
    for i in range(0, len(REPEATED), step):
        out += stream.push(REPEATED[i:i + step])
    out += stream.flush()
    got: dict = {}
    for delta in out:
        assert "content" not in delta
        for call in delta["tool_calls"]:
            got.setdefault(call["index"], [None, ""])
            got[call["index"]][0] = call.get("id") or got[call["index"]][0]
            got[call["index"]][1] += call["function"].get("arguments", "")
    _, whole = structured.parse_calls(REPEATED, "seed")
    assert [(c["id"], c["function"]["arguments"]) for c in whole] == [tuple(got[i]) for i in sorted(got)]
    assert [json.loads(a) for _, a in got.values()] == [{"city": "Oslo"}, {"city": "Rome"}]


def test_a_call_cut_short_sends_no_template_text():
    from chat.web.openai_tools import CallStream
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool'
    stream = CallStream()
    out = stream.push(text) + stream.flush()
    args = "".join(c["function"].get("arguments", "") for d in out for c in d.get("tool_calls", []))
    assert args == '{"city": "Rome"}'


def test_a_repeated_call_ends_the_answer(grammars):
    from chat import structured
    from chat.config import Settings
    from chat.engine.core.budget import Guard
    listed = structured.tools([WEATHER, TIME])
    matcher = grammars.matcher(structured.tools_grammar(listed, "required", True))
    guard = Guard(grammars.table, matcher, 500, Settings(), calls=True)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    eos = grammars.table.eos
    for text, ends in [(one, False), ("\n" + one.replace("Oslo", "Rome"), False), ("\n" + one, True)]:
        for t in grammars.hf.encode(text, add_special_tokens=False):
            assert matcher.consume_token(t)
            guard.took(t)
        bits = np.zeros(grammars.table.words, dtype=np.uint32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        guard.restrict(bits)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        assert (list(allowed) == [eos]) == ends
    assert not guard.closed  # a repeat ends the answer as stop, not for its budget
