"""The OpenAI-compatible API, driven by the official ``openai`` SDK and raw HTTP."""
from __future__ import annotations

import http.client
import json
import time

import pytest
from fakes import WORDS, AppServer, FakeEngine
from helpers import make_app, metric, wait_for

from chat.config import Settings
from chat.errors import Overloaded, PromptTooLong

openai = pytest.importorskip("openai")


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def app(engine):
    return make_app(engine, max_new_tokens=32, system_prompt="Be brief.")


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def live(app):
    server = AppServer(app)
    yield server
    server.close()


@pytest.fixture
def sdk(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=10)


HELLO = [{"role": "user", "content": "hi"}]


# ---- with a fake engine: fast, and every path scripted

def test_models(sdk):
    assert [m.id for m in sdk.models.list()] == ["fake-model"]
    assert sdk.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("other")


def test_non_streaming(sdk, engine):
    out = sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=5, temperature=0, seed=7)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "fake-model"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "".join(WORDS[:5])
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (2, 5, 7)
    params = engine.history[-1].params
    assert (params.temperature, params.max_new_tokens, params.seed) == (0.0, 5, 7)


def test_top_k_and_min_p_reach_the_engine(client, engine):
    client.post("/v1/chat/completions", json={"messages": HELLO, "top_k": 40, "min_p": 0.05})
    assert (engine.history[-1].params.top_k, engine.history[-1].params.min_p) == (40, 0.05)
    client.post("/v1/chat/completions", json={"messages": HELLO, "top_k": -1})
    assert (engine.history[-1].params.top_k, engine.history[-1].params.min_p) == (0, 0.0)


def test_streaming_matches_non_streaming(sdk):
    stream = sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=6, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    plain = sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=6)
    assert text == plain.choices[0].message.content


def test_streaming_without_usage_ends_with_finish_chunk(sdk):
    chunks = list(sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_finish_stop_when_answer_ends(sdk):
    out = sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=1000)
    # capped at the server's max_new_tokens (32 < 40 words)
    assert out.usage.completion_tokens == 32 and out.choices[0].finish_reason == "length"


def test_stop_sequences(sdk, engine):
    out = sdk.chat.completions.create(model="any", messages=HELLO, stop=["w3", "w2 "])
    assert out.choices[0].message.content == "w0 w1 " and out.choices[0].finish_reason == "stop"
    assert engine.history[-1].params.stop == ("w3", "w2 ")
    sdk.chat.completions.create(model="any", messages=HELLO, stop="w9", max_tokens=2)
    assert engine.history[-1].params.stop == ("w9",)


def test_n_above_one_is_refused(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="any", messages=HELLO, n=2)
    assert err.value.status_code == 400 and err.value.param == "n" and "n" in err.value.message


def test_system_prompt_goes_first_when_absent(client, engine):
    client.post("/v1/chat/completions", json={"messages": HELLO})
    assert engine.history[-1].messages == [{"role": "system", "content": "Be brief."}, *HELLO]
    own = [{"role": "developer", "content": "Be long."}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    client.post("/v1/chat/completions", json={"messages": own})
    assert engine.history[-1].messages == [{"role": "system", "content": "Be long."},
                                           {"role": "user", "content": "ab"}]


def _msgs(*roles):
    return [{"role": r, "content": "x"} for r in roles]


BAD = [
    # body, status, param
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": _msgs("function")}, 400, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [*_msgs("user"), {"role": "user"}]}, 400, "messages[1].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x" * 16001}]}, 413, "messages[0].content"),
    ({"messages": _msgs(*["user", "assistant"] * 500, "user")}, 413, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 15000}] * 18}, 413, "messages"),
    ({"messages": _msgs("user"), "top_k": -2}, 400, "top_k"),
    ({"messages": _msgs("user"), "top_k": 0.5}, 400, "top_k"),
    ({"messages": _msgs("user"), "min_p": 1.5}, 400, "min_p"),
    ({"messages": _msgs("user"), "temperature": 2.5}, 400, "temperature"),
    ({"messages": _msgs("user"), "temperature": -0.1}, 400, "temperature"),
    ({"messages": _msgs("user"), "temperature": "hot"}, 400, "temperature"),
    ({"messages": _msgs("user"), "top_p": 0}, 400, "top_p"),
    ({"messages": _msgs("user"), "top_p": 1.01}, 400, "top_p"),
    ({"messages": _msgs("user"), "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": _msgs("user"), "max_tokens": 1.5}, 400, "max_tokens"),
    ({"messages": _msgs("user"), "max_completion_tokens": True}, 400, "max_completion_tokens"),
    ({"messages": _msgs("user"), "seed": "x"}, 400, "seed"),
    ({"messages": _msgs("user"), "seed": 2**64}, 400, "seed"),
    ({"messages": _msgs("user"), "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": _msgs("user"), "stop": [""]}, 400, "stop"),
    ({"messages": _msgs("user"), "stop": 3}, 400, "stop"),
    ({"messages": _msgs("user"), "n": 2}, 400, "n"),
    ({"messages": _msgs("user"), "n": 0}, 400, "n"),
    ({"messages": _msgs("user"), "stream": "yes"}, 400, "stream"),
    ({"messages": _msgs("user"), "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ({"messages": _msgs("user"), "model": 3}, 400, "model"),
    ({"messages": _msgs("user"), "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"messages": _msgs("user"), "logprobs": "yes"}, 400, "logprobs"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_requests(client, engine, body, status, param):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.get_json()["error"]
    assert error["param"] == param and error["message"] and error["type"] and error["code"]
    assert not engine.history


def test_invalid_json(client):
    response = client.post("/v1/chat/completions", data=b"{not json", content_type="application/json")
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "invalid_json"


def test_nulls_count_as_absent_and_unknown_fields_are_ignored(client, engine):
    response = client.post("/v1/chat/completions", json={
        "messages": HELLO, "temperature": None, "stop": None, "frequency_penalty": 0.5, "user": "u"})
    assert response.status_code == 200
    assert engine.history[-1].params.temperature == Settings().temperature


def test_engine_refusals_map_to_http(client, engine):
    engine.refuse = Overloaded("queue full")
    response = client.post("/v1/chat/completions", json={"messages": HELLO})
    assert response.status_code == 503 and response.get_json()["error"]["code"] == "overloaded"
    engine.refuse = PromptTooLong("prompt too long")
    assert client.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 413


def test_not_ready_is_503(client, engine):
    engine.ready = False
    for response in (client.get("/v1/models"), client.post("/v1/chat/completions", json={"messages": HELLO})):
        assert response.status_code == 503 and response.get_json()["error"]["code"] == "model_not_ready"


def test_api_key_required_when_set():
    server = AppServer(make_app(FakeEngine(), api_key="s3cret"))
    try:
        for key in ("wrong", "s3cret-and-more", "s3cre"):
            bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model="any", messages=HELLO)
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="any", messages=HELLO, max_tokens=2).choices[0].message.content
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert response.status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
        assert json.loads(response.read())["error"]["type"] == "authentication_error"
    finally:
        server.close()


def test_engine_error_mid_stream(sdk, engine, client, caplog):
    """The engine's own message (it may name the backend) goes to the log; the client gets a request id."""
    engine.fail_after = 3
    stream = sdk.chat.completions.create(model="any", messages=HELLO, stream=True)
    seen = []
    with pytest.raises(openai.APIError, match=r"engine failed while generating \(request id chatcmpl-") as err:
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "".join(WORDS[:3]) and "scripted failure" not in str(err.value)
    response = client.post("/v1/chat/completions", json={"messages": HELLO})
    message = response.get_json()["error"]["message"]
    assert response.status_code == 500 and "scripted failure" not in message
    request_id = message.rsplit(" ", 1)[1].rstrip(")")
    assert f"generation {request_id} failed: scripted failure" in caplog.text


def _raw_stream(port, body, read_chunks=None):
    """POST a streaming request; (response headers, [(seconds since send, line)])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    lines = []
    while read_chunks is None or len(lines) < read_chunks:
        line = response.readline()
        if not line:
            break
        if line.strip():
            lines.append((time.monotonic() - t0, line.decode().strip()))
    return conn, response, lines


def test_sse_chunks_arrive_incrementally(live, engine):
    engine.delay = 0.05
    conn, response, lines = _raw_stream(live.port, {"messages": HELLO, "max_tokens": 10, "stream": True})
    conn.close()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    assert response.getheader("Cache-Control") == "no-cache"
    assert response.getheader("X-Accel-Buffering") == "no"
    assert response.getheader("Content-Length") is None
    assert all(line.startswith("data: ") for _, line in lines) and lines[-1][1] == "data: [DONE]"
    contents = [(t, json.loads(line[6:])) for t, line in lines[:-1]]
    deltas = [t for t, c in contents if c["choices"][0]["delta"].get("content")]
    assert len(deltas) == 10
    assert contents[0][0] < 0.2 and deltas[0] < deltas[-1] - 0.3  # spread over ~0.5 s, not one burst


def test_closing_the_stream_cancels_the_generation(live, engine):
    engine.delay = 0.05
    conn, response, lines = _raw_stream(live.port, {"messages": HELLO, "stream": True}, read_chunks=3)
    assert len(lines) == 3
    conn.close()
    response.close()
    gen = engine.history[-1]
    assert wait_for(lambda: gen.cancel_reason == "cancelled" and engine.stats()["active"] == 0)
    assert len(engine.history) == 1


def test_sdk_closing_the_stream_cancels(sdk, engine):
    engine.delay = 0.05
    stream = sdk.chat.completions.create(model="any", messages=HELLO, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert wait_for(lambda: engine.stats()["active"] == 0)
    assert engine.history[-1].cancel_reason == "cancelled"


def test_engine_error_event_before_start(sdk, client, engine):
    engine.reject = PromptTooLong("the prompt does not fit")
    response = client.post("/v1/chat/completions", json={"messages": HELLO})
    assert response.status_code == 413 and response.get_json()["error"]["code"] == "too_large"
    with pytest.raises(openai.APIError, match="does not fit"):
        list(sdk.chat.completions.create(model="any", messages=HELLO, stream=True))


def test_body_size_limit(client, monkeypatch):
    monkeypatch.setattr("chat.web.openai_api.MAX_BODY_BYTES", 100)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 200}]})
    assert response.status_code == 413 and response.get_json()["error"]["code"] == "too_large"


def test_keepalive_comments_while_silent(live, sdk, engine, monkeypatch):
    monkeypatch.setattr("chat.web.openai_api.KEEPALIVE_S", 0.02)
    engine.delay = 0.1
    conn, _, lines = _raw_stream(live.port, {"messages": HELLO, "max_tokens": 2, "stream": True})
    conn.close()
    assert ": keep-alive" in [line for _, line in lines] and lines[-1][1] == "data: [DONE]"
    chunks = list(sdk.chat.completions.create(model="any", messages=HELLO, max_tokens=2, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 "


def test_rate_limited_per_address(engine):
    client = make_app(engine, rate_limit_per_ip_per_min=2).test_client()
    codes = [client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}).status_code
             for _ in range(3)]
    assert codes == [200, 200, 429]


# ---- against the real server: gunicorn + gevent, tiny model (fixtures in conftest.py)

STORY = [{"role": "user", "content": "Tell me a long story."}]


def live_sdk(server, key="unused"):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_live_stream_equals_non_stream(server):
    sdk = live_sdk(server)
    model = sdk.models.list().data[0].id
    kwargs = dict(model=model, messages=STORY, max_tokens=24, temperature=0, seed=1)
    plain = sdk.chat.completions.create(**kwargs)
    assert plain.model == model and plain.choices[0].finish_reason in ("stop", "length")
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    usage = chunks[-1].usage
    assert usage.prompt_tokens == plain.usage.prompt_tokens > 0
    assert usage.completion_tokens == plain.usage.completion_tokens <= 24


def test_live_stop_sequence(server):
    sdk = live_sdk(server)
    kwargs = dict(model="any", messages=STORY, max_tokens=40, temperature=0)
    full = sdk.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) > 6, full
    middle = len(full) // 2
    stop = full[middle:middle + 3]
    cut = sdk.chat.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].message.content == full[:full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_live_errors(server):
    sdk = live_sdk(server)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="any", messages=STORY, n=2)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="any", messages=STORY, temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="any", messages=[{"role": "robot", "content": "x"}])
    assert err.value.param == "messages[0].role"


def test_live_api_key(server_factory):
    keyed = server_factory("keyed", CHAT_API_KEY="k-123")
    with pytest.raises(openai.AuthenticationError):
        live_sdk(keyed, "wrong").chat.completions.create(model="any", messages=STORY, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        live_sdk(keyed, "wrong").models.list()
    out = live_sdk(keyed, "k-123").chat.completions.create(model="any", messages=STORY, max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_live_sse_chunks_arrive_incrementally(server):
    body = {"model": "any", "messages": STORY, "max_tokens": 60, "temperature": 0, "stream": True}
    conn, response, lines = _raw_stream(server.port, body)
    conn.close()
    assert response.getheader("X-Accel-Buffering") == "no" and response.getheader("Cache-Control") == "no-cache"
    assert lines[-1][1] == "data: [DONE]"
    times = [t for t, line in lines[:-1]
             if line.startswith("data: ") and json.loads(line[6:])["choices"]
             and json.loads(line[6:])["choices"][0]["delta"].get("content")]
    total = lines[-1][0]
    assert len(times) > 10
    assert times[0] < total / 2, f"first content at {times[0]:.3f} s of {total:.3f} s: buffered"
    assert len({round(t, 2) for t in times}) > 3


def test_live_closing_the_stream_cancels(server):
    assert wait_for(lambda: metric(server, "chat_active_generations") == 0, timeout=15)
    body = {"model": "any", "messages": STORY, "max_tokens": 4000, "temperature": 0, "stream": True}
    conn, response, lines = _raw_stream(server.port, body, read_chunks=6)
    assert len(lines) == 6 and metric(server, "chat_active_generations") == 1
    conn.close()
    response.close()
    closed = time.monotonic()
    assert wait_for(lambda: metric(server, "chat_active_generations") == 0, timeout=5)
    assert time.monotonic() - closed < 2, "the engine kept generating after the client left"
    assert wait_for(lambda: "client closed the stream; generation cancelled" in server.log())
