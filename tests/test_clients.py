"""Real client libraries against the real engine (tiny random model, the worst case for JSON), at the
server's default sampling and small ``max_tokens``: the OpenAI SDK's ``parse`` and streamed tool calls,
instructor in its JSON_SCHEMA and TOOLS modes, langchain-openai's ``bind_tools``; each against the local
engine and through the remote backend in front of a second instance.

The tiny model never ends a string on its own, so its JSON answers are closed by their budget: valid,
with ``finish_reason: "length"``, which the SDK's ``parse`` and instructor's JSON modes treat as a
failure (they raise, the valid JSON in hand). The bundled model finishes on its own at these budgets
(``test_clients_real_model.py``)."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from chat.config import Settings
from chat.engine.remote.client import RemoteEngine
from fakes import AppServer
from helpers import make_app, make_engine, wait_for

openai = pytest.importorskip("openai")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")
from instructor.core.exceptions import IncompleteOutputException  # noqa: E402 (once instructor is known)


class Fruit(BaseModel):
    name: str
    color: str


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "sunny"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Name a fruit and its color."}]


@pytest.fixture(scope="module", params=["local", "remote"])
def url(request, tiny_model, tmp_path_factory):
    """The local engine; or a server with the remote backend in front of a second instance (the same clients
    must pass through it)."""
    engine = make_engine(tiny_model, tmp_path_factory.mktemp("clients"))
    server = AppServer(make_app(engine, max_new_tokens=512))
    front = front_engine = None
    if request.param == "remote":
        front_engine = RemoteEngine(Settings(backend="openai", backend_url=f"{server.url}/v1"))
        wait_for(lambda: front_engine.ready or front_engine.error)
        front = AppServer(make_app(front_engine, max_new_tokens=512))
    yield f"{(front or server).url}/v1"
    if front is not None:
        front.close()
        front_engine.shutdown()
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def sdk(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("max_tokens", [16, 40])
def test_openai_parse(sdk, max_tokens):
    for _ in range(3):
        try:
            out = sdk.chat.completions.parse(model="m", messages=ASK, response_format=Fruit, max_tokens=max_tokens)
            assert isinstance(out.choices[0].message.parsed, Fruit)
        except openai.LengthFinishReasonError as exc:  # closed for its budget: said so, and still valid
            assert exc.completion.usage.completion_tokens <= max_tokens
            Fruit.model_validate_json(exc.completion.choices[0].message.content)


def test_openai_streamed_tool_calls(sdk):
    for _ in range(3):
        with sdk.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         max_tokens=40) as stream:
            for _event in stream:
                pass
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
@pytest.mark.parametrize("max_tokens", [40, 80])
def test_instructor(sdk, mode, max_tokens):
    client = instructor.from_openai(sdk, mode=getattr(instructor.Mode, mode))
    for _ in range(3):
        try:
            fruit = client.chat.completions.create(model="m", messages=ASK, response_model=Fruit,
                                                   max_tokens=max_tokens, max_retries=0)
        except IncompleteOutputException as exc:
            assert mode == "JSON_SCHEMA"  # a tool call says tool_calls, whatever closed it
            fruit = Fruit.model_validate_json(exc.last_completion.choices[0].message.content)
        assert isinstance(fruit, Fruit)


def test_langchain_bind_tools(url):
    llm = langchain_openai.ChatOpenAI(base_url=url, api_key="unused", model="m", max_tokens=40, max_retries=0)
    for choice in ("get_weather", "any"):
        bound = llm.bind_tools([get_weather], tool_choice=choice)
        for _ in range(2):
            message = bound.invoke("What is the weather in Rome?")
            (call,) = message.tool_calls
            assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="get_weather").stream("Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    (call,) = streamed.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
