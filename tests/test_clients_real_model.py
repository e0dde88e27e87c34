"""Real client libraries against the real bundled model (SmolLM2-135M-Instruct) at the server's default
sampling (seeded, so a run is repeatable) and small ``max_tokens``: instructor's JSON_SCHEMA and TOOLS
modes, the OpenAI SDK's ``parse`` and streamed tool calls, langchain-openai's ``bind_tools``."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")

ASK = [{"role": "user", "content": "Name a fruit and its color."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Fruit(BaseModel):
    name: str
    color: str


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "sunny"


@pytest.mark.real_model
def test_real_clients_on_the_bundled_model(server_factory):
    srv = server_factory("real-clients", CHAT_MODEL="", CHAT_DTYPE="auto", CHAT_RATE_LIMIT_PER_IP_PER_MIN="0")
    sdk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(sdk, mode=mode)
        for seed in range(5):
            fruit = client.chat.completions.create(model="m", messages=ASK, response_model=Fruit, max_tokens=80,
                                                   seed=seed, max_retries=0)
            assert isinstance(fruit, Fruit)
    for seed in range(5):
        out = sdk.chat.completions.parse(model="m", messages=ASK, response_format=Fruit, max_tokens=80, seed=seed)
        assert isinstance(out.choices[0].message.parsed, Fruit)
        with sdk.chat.completions.stream(model="m", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                         tools=[WEATHER], tool_choice="required", max_tokens=40, seed=seed) as s:
            final = s.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    llm = langchain_openai.ChatOpenAI(base_url=f"{srv.url}/v1", api_key="unused", model="m", max_tokens=40,
                                      max_retries=0, seed=1)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Rome?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
