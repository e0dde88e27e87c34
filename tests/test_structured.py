"""Structured answers on /v1 with the real engine (tiny random model): JSON-schema constrained output,
tool calls, log probabilities, /v1/completions with echo; through the official ``openai`` SDK."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest
from fakes import AppServer
from helpers import WS, make_app, make_engine, text_of
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
HELLO = [{"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = make_engine(tiny_model, tmp_path_factory.mktemp("structured"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    return make_app(engine, max_new_tokens=256)


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


@pytest.fixture(scope="module")
def live(app):
    server = AppServer(app)
    yield server
    server.close()


@pytest.fixture(scope="module")
def sdk(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_json_schema_answers_validate(sdk, seed):
    out = sdk.chat.completions.create(model="m", messages=HELLO, response_format=FORMAT, temperature=1.0,
                                      seed=seed, max_tokens=200)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_schema_streamed_equals_whole(sdk):
    kwargs = dict(model="m", messages=HELLO, response_format=FORMAT, temperature=0, max_tokens=200)
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole), PERSON)


def test_json_object(sdk):
    out = sdk.chat.completions.create(model="m", messages=HELLO, response_format={"type": "json_object"},
                                      temperature=0.8, seed=5, max_tokens=256)
    if out.choices[0].finish_reason == "stop":  # a random model may write one long string
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


def test_length_ends_with_what_was_generated(sdk):
    out = sdk.chat.completions.create(model="m", messages=HELLO, response_format=FORMAT, temperature=0,
                                      max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content.startswith("{")


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)


def test_sdk_parse_with_pydantic(sdk):
    parse = getattr(getattr(sdk, "beta", sdk).chat.completions, "parse", None) or sdk.chat.completions.parse
    out = parse(model="m", messages=HELLO, response_format=Pet, temperature=0, max_tokens=100)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_constrained_row_leaves_the_others_alone(engine):
    from helpers import QUESTIONS, ask, collect

    from chat import structured
    from chat.engine import GenParams
    alone = [collect(engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=30)))[0] for q in QUESTIONS]
    grammar = structured.schema_grammar(PERSON)
    gens = [engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=30)) for q in QUESTIONS]
    constrained = [engine.submit(ask(q), GenParams(temperature=0, max_new_tokens=60, grammar=grammar))
                   for q in QUESTIONS]
    assert [collect(g)[0] for g in gens] == alone
    for g in constrained:
        text, events = collect(g)
        assert events[-1].reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_compiled_grammars_are_cached(engine, sdk):
    schema = {"type": "object", "properties": {"x": {"enum": ["cached"]}}, "required": ["x"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    before = engine.grammars.compiled
    for _ in range(3):
        out = sdk.chat.completions.create(model="m", messages=HELLO, response_format=fmt, max_tokens=20)
        assert json.loads(out.choices[0].message.content) == {"x": "cached"}
    assert engine.grammars.compiled == before + 1


# ---- tools

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call(sdk, choice):
    out = sdk.chat.completions.create(model="m", messages=HELLO, tools=[WEATHER, TIME], tool_choice=choice,
                                      parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls"
    (call,) = choice0.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_auto_is_text_or_valid_calls(sdk, seed):
    out = sdk.chat.completions.create(model="m", messages=HELLO, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
                                      max_tokens=60)
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    else:
        assert not choice.message.tool_calls and not choice.message.content.startswith("<")


def test_tool_call_streamed(sdk):
    kwargs = dict(model="m", messages=HELLO, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_tokens=120, parallel_tool_calls=False)
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls: dict = {}
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = d.id or slot["id"]
            slot["name"] += (d.function.name or "") if d.function else ""
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert list(calls) == [0]
    assert calls[0]["name"] == whole.function.name and calls[0]["arguments"] == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_in_history(sdk, engine):
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"}]
    out = sdk.chat.completions.create(model="m", messages=history, tools=[WEATHER], tool_choice="none",
                                      temperature=0, max_tokens=10)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls


def test_tools_prompt_reaches_the_model(engine):
    from chat.engine.core import prompt
    tok = engine.loaded.tokenizer
    ids = prompt.render(tok, [{"role": "user", "content": "hi"}], (WEATHER,))
    text = tok.decode(ids)
    assert "get_weather" in text and "<tool_call>" in text


CALLS = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


@pytest.mark.parametrize("text, content, calls", [
    (CALLS, "Sure.", [("get_weather", '{"city": "Oslo", "unit": "c"}'), ("get_time", '{"zone": "utc"}')]),
    (CALLS[:75], "Sure.", [("get_weather", '{"city": "Oslo", "uni')]),  # cut short by length
    ("a <b> c <tool_call>\n{\"x\": 1}\n</tool_call>", "a <b> c <tool_call>\n{\"x\": 1}\n</tool_call>", []),
    ("<tool_c", "<tool_c", []),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_call_stream_is_the_same_however_the_text_is_cut(text, content, calls, step):
    from chat.web.openai_tools import CallStream
    stream, out = CallStream(), []
    for i in range(0, len(text), step):
        out += stream.push(text[i:i + step])
    out += stream.flush()
    got: dict = {}
    for delta in out:
        for call in delta.get("tool_calls", []):
            entry = got.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"].get("arguments", "")
    assert "".join(d.get("content", "") for d in out) == content
    assert [tuple(got[i]) for i in sorted(got)] == calls
    assert len([d for d in out if d.get("tool_calls") and "id" in d["tool_calls"][0]]) == len(calls)


# ---- log probabilities

def test_logprobs_streamed_and_whole(sdk):
    kwargs = dict(model="m", messages=HELLO, logprobs=True, top_logprobs=3, temperature=0, max_tokens=12)
    whole = sdk.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:  # greedy: the chosen token is the most likely one of the raw distribution
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert sum(math.exp(a.logprob) for a in e.top_logprobs) <= 1 + 1e-4
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_logprobs_are_the_unmodified_distribution(sdk):
    """Sampled hot and constrained, the values are still the raw model's: a constrained first token is
    far less likely than the raw distribution's favourite."""
    out = sdk.chat.completions.create(model="m", messages=HELLO, logprobs=True, top_logprobs=1, temperature=1.7,
                                      seed=3, extra_body={"top_k": 5}, response_format=FORMAT, max_tokens=60)
    first = out.choices[0].logprobs.content[0]
    assert first.token.startswith("{")
    assert first.logprob < first.top_logprobs[0].logprob  # the raw favourite is not JSON


def _reference_logprobs(engine, text):
    import torch
    tok = engine.loaded.tokenizer
    ids = tok.encode(text)
    with torch.inference_mode():
        model = engine.loaded.model
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_completions_echo_scores_every_prompt_token(client, engine):
    text = "The quick brown fox jumps over the lazy dog."
    body = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True,
                                                "logprobs": 2}).get_json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == text and lp["token_logprobs"][0] is None
    # against transformers' own forward of the same weights (the engine runs its own decoder)
    assert lp["token_logprobs"][1:] == pytest.approx(_reference_logprobs(engine, text), abs=1e-3)
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0


def test_completions_generate_and_stream(sdk):
    whole = sdk.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0, echo=True,
                                   logprobs=1)
    assert whole.choices[0].text.startswith("Once upon a time")
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(sdk.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0,
                                         echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


# ---- bad input: a clear 400, the engine untouched

BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                         for i in range(200)}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"type": "array", "items": ' * 20 + '{}' + '}' * 20)}}}, "response_format.json_schema.schema"),
    ({"tools": [WEATHER] * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(40)]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_structured_requests(client, extra, param):
    response = client.post("/v1/chat/completions", json={"messages": HELLO, **extra})
    assert response.status_code == 400, response.get_json()
    assert response.get_json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [({"prompt": ""}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
                                         ({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({}, "prompt")])
def test_bad_completions_requests(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.get_json()["error"]["param"] == param


# ---- over the WebSocket: the same fields in ``chat`` params

def test_ws_chat_with_a_schema(live):
    client = WS(live.ws_url)
    frames = client.chat("Describe a pet.", params={"temperature": 0, "max_new_tokens": 120, "response_format": FORMAT})
    client.close()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "stop", frames[-1]
    jsonschema.validate(json.loads(text_of(frames)), PERSON)


def test_ws_tool_call_in_done_frame(live):
    client = WS(live.ws_url)
    frames = client.chat("Weather?", params={"temperature": 0, "max_new_tokens": 120, "tools": [WEATHER],
                                             "tool_choice": "required", "parallel_tool_calls": False})
    client.close()
    done = frames[-1]
    assert done["type"] == "done" and "<tool_call>" in text_of(frames)
    (call,) = done["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("params", [{"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                                    {"tools": [{"type": "function"}]}, {"tool_choice": "required"}])
def test_ws_bad_structured_params(live, params):
    client = WS(live.ws_url)
    frames = client.chat("hi", params=params)
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_message" and "params" in frames[-1]["message"]
    assert client.ping()["type"] == "pong"  # the connection keeps working
    client.close()


def test_ws_continue_refuses_a_schema(live):
    client = WS(live.ws_url)
    frames = client.chat("Describe a pet.", params={"temperature": 0, "max_new_tokens": 3})
    conv = next(f for f in frames if f["type"] == "start")["conversation_id"]
    client.send({"type": "continue", "id": "r2", "conversation_id": conv, "params": {"response_format": FORMAT}})
    frames = client.until(lambda f: f.get("id") == "r2" and f["type"] in ("done", "error"))
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_message"
    assert "response_format" in frames[-1]["message"]
    client.close()


# ---- the real server (gunicorn + gevent, tiny model)

def test_live_server_schema_and_tools(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = sdk.chat.completions.create(model="m", messages=HELLO, response_format=FORMAT, temperature=0,
                                      max_tokens=200)
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    chunks = list(sdk.chat.completions.create(model="m", messages=HELLO, tools=[WEATHER], tool_choice="required",
                                              temperature=0, max_tokens=120, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


def test_a_failed_matcher_never_masks_its_whole_row(engine):
    import torch

    from chat import structured
    from chat.engine.core import grammar

    class Row:
        def __init__(self, matcher):
            self.matcher, self.guard = matcher, None

    ok = engine.grammars.matcher(structured.schema_grammar(PERSON))
    broken = engine.grammars.matcher(structured.schema_grammar(PERSON))
    broken.consume_token(engine.loaded.tokenizer.encode("x")[0])  # not JSON: the matcher fails
    assert broken.is_error()
    logits = torch.zeros(3, engine.grammars.vocab)
    failed = grammar.apply_masks(logits, [Row(ok), Row(None), Row(broken)])
    assert [r.matcher for r in failed] == [broken]
    assert torch.isinf(logits[0]).sum() > 0 and not torch.isinf(logits[1]).any() and not torch.isinf(logits[2]).any()

    # row 0's mask is the matcher's own answer, token by token (a sample of the vocabulary)
    for prefix in ('{"name": "Ad', '{"name": "Ada", "age": 3'):
        m = engine.grammars.matcher(structured.schema_grammar(PERSON))
        assert m.consume_tokens(engine.loaded.tokenizer.encode(prefix))
        logits = torch.zeros(1, engine.grammars.vocab)
        grammar.apply_masks(logits, [Row(m)])
        sample = [t for t in range(0, engine.grammars.vocab, 97) if t not in engine.loaded.eos_ids]
        assert [not torch.isinf(logits[0, t]).item() for t in sample] == [m.validate_tokens([t]) == 1 for t in sample]
