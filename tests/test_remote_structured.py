"""The remote backend in front of a second instance of this server (a real engine on the tiny model):
``response_format``, tools, log probabilities and ``/v1/completions`` with ``echo`` reach the upstream,
its answers come back in OpenAI's shape over /v1 and the WebSocket, and its refusals reach the client."""
from __future__ import annotations

import json

import jsonschema
import pytest

from chat.config import Settings
from chat.engine.remote.client import RemoteEngine
from fakes import AppServer
from helpers import NAMED_WEATHER as NAMED
from helpers import TIME_TOOL as TIME
from helpers import WEATHER_TOOL as WEATHER
from helpers import WS, make_app, make_engine, wait_for

openai = pytest.importorskip("openai")

PAIR = {"type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}},
        "required": ["name", "color"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def upstream(tiny_model, tmp_path_factory):
    engine = make_engine(tiny_model, tmp_path_factory.mktemp("upstream"))
    server = AppServer(make_app(engine, max_new_tokens=256, max_messages=6))
    yield server
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def front(upstream):
    engine = RemoteEngine(Settings(backend="openai", backend_url=f"{upstream.url}/v1"))
    wait_for(lambda: engine.ready or engine.error)
    server = AppServer(make_app(engine, max_new_tokens=256))
    yield server
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def sdks(upstream, front):
    def sdk(server):
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return sdk(upstream), sdk(front)


def test_json_schema_through_the_backend(sdks):
    direct, front = sdks
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": PAIR}}
    for max_tokens in (20, 60):
        kwargs = dict(model="m", messages=ASK, response_format=fmt, max_tokens=max_tokens, temperature=0)
        out = front.chat.completions.create(**kwargs)
        jsonschema.validate(json.loads(out.choices[0].message.content), PAIR)
        assert out.choices[0].message.content == direct.chat.completions.create(**kwargs).choices[0].message.content
        assert out.choices[0].finish_reason == direct.chat.completions.create(**kwargs).choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_through_the_backend(sdks, stream):
    _, front = sdks
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=60, temperature=0)
    if not stream:
        out = front.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason == "tool_calls"
        (call,) = out.message.tool_calls
        name, args = call.function.name, call.function.arguments
    else:
        calls: dict = {}
        finish = None
        for chunk in front.chat.completions.create(stream=True, **kwargs):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or d.id
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            assert not (chunk.choices and chunk.choices[0].delta.content)
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert finish == "tool_calls" and list(calls) == [0] and calls[0]["id"]
        name, args = calls[0]["name"], calls[0]["arguments"]
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_logprobs_through_the_backend(sdks):
    direct, front = sdks
    kwargs = dict(model="m", messages=ASK, logprobs=True, top_logprobs=2, max_tokens=8, temperature=0)
    here, there = front.chat.completions.create(**kwargs), direct.chat.completions.create(**kwargs)
    got = here.choices[0].logprobs.content
    assert got and [e.token for e in got] == [e.token for e in there.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in got)
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in there.choices[0].logprobs.content])
    streamed = [e for c in front.chat.completions.create(stream=True, **kwargs)
                for e in ((c.choices[0].logprobs.content or []) if c.choices and c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in got]


def test_completions_echo_through_the_backend(sdks):
    direct, front = sdks
    kwargs = dict(model="m", prompt="The capital of France is", max_tokens=4, echo=True, logprobs=1, temperature=0)
    here, there = front.completions.create(**kwargs).choices[0], direct.completions.create(**kwargs).choices[0]
    assert here.text == there.text and here.text.startswith("The capital of France is")
    assert here.logprobs.tokens == there.logprobs.tokens
    assert here.logprobs.token_logprobs[0] is None
    assert here.logprobs.token_logprobs[1:] == pytest.approx(there.logprobs.token_logprobs[1:])


def test_an_upstream_refusal_reaches_the_client(sdks):
    _, front = sdks
    many = [{"role": "user", "content": f"m{i}"} for i in range(9)]  # the upstream takes at most 6
    with pytest.raises(openai.APIStatusError) as err:
        front.chat.completions.create(model="m", messages=many, max_tokens=4)
    assert err.value.status_code == 413 and "6 messages" in err.value.message


def test_the_websocket_through_the_backend(front):
    client = WS(front.ws_url)
    frames = client.chat("Weather in Rome?", params={"tools": [WEATHER], "tool_choice": "required",
                                                     "max_new_tokens": 60, "temperature": 0})
    client.close()
    done = frames[-1]
    assert done["type"] == "done", done
    (call,) = done["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    client = WS(front.ws_url)
    frames = client.chat("Hi", rid="t2", params={"logprobs": True, "top_logprobs": 2, "max_new_tokens": 6})
    client.close()
    entries = [e for f in frames if f["type"] == "delta" for e in f.get("logprobs", [])]
    assert frames[-1]["type"] == "done" and len(entries) == frames[-1]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_relay_writes_upstream_tool_calls_as_the_local_engine_does():
    from chat import structured
    from chat.engine.remote.fields import Relay
    relay = Relay()
    chunks = [{"delta": {"reasoning_content": "thinking"}},
              {"delta": {"content": "Let me look."}},
              {"delta": {"tool_calls": [{"index": 0, "id": "up1",
                                         "function": {"name": "get_weather", "arguments": ""}}]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}},
              {"delta": {"tool_calls": [{"index": 1, "id": "up2", "function": {"name": "get_time",
                                                                              "arguments": '{"zone": "cet"}'}}]},
               "logprobs": {"content": [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}]}}]
    deltas = [d for c in chunks for d in relay.chat(c)] + relay.end()
    assert [d.reasoning for d in deltas if d.reasoning] == ["thinking"]
    assert [e["token"] for d in deltas for e in d.logprobs] == ["x"]
    content, calls = structured.parse_calls("".join(d.text for d in deltas), "seed")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "cet"})]


def scripted(lines: list) -> tuple:
    """A scripted upstream that streams ``lines`` to every chat call: (its server, the bodies it was sent)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    bodies: list = []

    class Upstream(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "thinker"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for line in lines:
                self.wfile.write(f"data: {json.dumps(line)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, bodies


def test_reasoning_comes_back_in_openai_shape():
    """An upstream reasoning model's ``reasoning_content`` reaches /v1 clients, whole and streamed."""
    lines = [{"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "Hm, "}}]},
             {"choices": [{"index": 0, "delta": {"reasoning_content": "blue."}}]},
             {"choices": [{"index": 0, "delta": {"content": "Blue."}, "finish_reason": "stop"}]}]
    httpd, _ = scripted(lines)
    engine = RemoteEngine(Settings(backend="openai", backend_url=f"http://127.0.0.1:{httpd.server_port}/v1"))
    wait_for(lambda: engine.ready or engine.error)
    server = AppServer(make_app(engine))
    try:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        whole = sdk.chat.completions.create(model="m", messages=ASK).choices[0].message
        assert whole.content == "Blue." and whole.model_extra["reasoning_content"] == "Hm, blue."
        chunks = [c.choices[0].delta for c in sdk.chat.completions.create(model="m", messages=ASK, stream=True)
                  if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == "Hm, blue."
        assert "".join(d.content or "" for d in chunks) == "Blue."
    finally:
        server.close()
        engine.shutdown()
        httpd.shutdown()


def test_a_tool_round_trip_reaches_the_upstream_as_openai_writes_it():
    """A history with a tool call and its result goes upstream in OpenAI's own shape (the upstream's
    template renders it), after the server's system prompt; the upstream's call comes back as tool_calls."""
    def piece(call: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]}, "finish_reason": finish}]}
    lines = [piece({"id": "u1", "type": "function", "function": {"name": "get_time", "arguments": ""}}),
             piece({"function": {"arguments": '{"zone"'}}),
             piece({"function": {"arguments": ': "cet"}'}}, "tool_calls")]
    httpd, bodies = scripted(lines)
    engine = RemoteEngine(Settings(backend="openai", backend_url=f"http://127.0.0.1:{httpd.server_port}/v1"))
    wait_for(lambda: engine.ready or engine.error)
    server = AppServer(make_app(engine))
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    try:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        out = sdk.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME])
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "cet"}
        sent = bodies[-1]
        assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
        assert sent["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert sent["messages"][3] == {"role": "tool", "content": "22 C and sunny", "tool_call_id": "call_1"}
        assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "get_time"]
        assert sent["parallel_tool_calls"] is False and "tool_choice" not in sent
    finally:
        server.close()
        engine.shutdown()
        httpd.shutdown()


# llama.cpp's server (--jinja) on Qwen2.5-Coder-0.5B-Instruct answers a named or required tool choice with the
# call written as text (measured: bench.answers), here as it streamed it, then prose up to the token limit
WRITTEN = ["```", "json", "\n", '{"name": "get_weather", ', '"arguments": {"city": ', '"Rome"}}', "\n```",
           "\n\nYou can call the function with the city."]


def _relayed(relay, pieces: list[str]) -> str:
    deltas = [d for p in pieces for d in relay.chat({"delta": {"content": p}})]
    return "".join(d.text for d in deltas + relay.end())


def test_a_forced_call_written_as_text_is_read_as_the_call():
    from chat import structured
    from chat.engine.remote.fields import Relay
    forced = frozenset({"get_weather"})
    relay = Relay(forced=forced)
    assert relay.chat({"delta": {"content": WRITTEN[0]}}) == []  # held until the answer ends
    content, calls = structured.parse_calls(_relayed(relay, WRITTEN[1:]), "seed")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"})]
    assert content == "You can call the function with the city."
    # bare JSON too; a call to another function, prose, or a choice that obliges nothing stay text
    assert structured.parse_calls(_relayed(Relay(forced=forced), ['{"name": "get_weather", "arguments": {}}']))[1]
    for pieces, names in ((WRITTEN, frozenset({"get_time"})), (["It is sunny in Rome."], forced),
                          (WRITTEN, frozenset())):
        assert _relayed(Relay(forced=names), pieces) == "".join(pieces)
    # an answer cut short (cancelled, the stream dropped) keeps its text as text
    relay = Relay(forced=forced)
    for piece in WRITTEN[:6]:
        relay.chat({"delta": {"content": piece}})
    assert "".join(d.text for d in relay.held()) == "".join(WRITTEN[:6])
    # an upstream that sends tool_calls itself: its text before them is text, its calls relayed as they come
    relay = Relay(forced=forced)
    out = relay.chat({"delta": {"content": "Sure."}})
    out += relay.chat({"delta": {"tool_calls": [{"index": 0, "function": {"name": "get_weather",
                                                                         "arguments": '{"city": "Rome"}'}}]}})
    content, calls = structured.parse_calls("".join(d.text for d in out + relay.end()))
    assert content == "Sure." and len(calls) == 1


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_written_as_text_reaches_clients_as_a_tool_call(choice):
    """In front of an upstream that writes the forced call as text, /v1 clients get one call, whole and streamed,
    with finish_reason tool_calls; the upstream was asked with the choice as the client sent it."""
    lines = [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in WRITTEN]
    lines[-1]["choices"][0]["finish_reason"] = "length"
    httpd, bodies = scripted(lines)
    engine = RemoteEngine(Settings(backend="openai", backend_url=f"http://127.0.0.1:{httpd.server_port}/v1"))
    wait_for(lambda: engine.ready or engine.error)
    server = AppServer(make_app(engine))
    try:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        kwargs = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40)
        whole = sdk.chat.completions.create(**kwargs).choices[0]
        assert bodies[-1]["tool_choice"] == choice
        (call,) = whole.message.tool_calls
        assert whole.finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
        calls: dict = {}
        finish = None
        for chunk in sdk.chat.completions.create(stream=True, **kwargs):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or d.id
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Rome"})]
        assert calls[0]["id"]
    finally:
        server.close()
        engine.shutdown()
        httpd.shutdown()
