"""The real bundled model (SmolLM2-135M-Instruct) asked for JSON: with a schema every answer parses and
validates; a tool call's arguments follow the tool's schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from bench.schemas import SCHEMAS, prompts

openai = pytest.importorskip("openai")


@pytest.mark.real_model
def test_bundled_model_answers_follow_the_schema(server_factory):
    srv = server_factory("real-structured", CHAT_MODEL="", CHAT_DTYPE="auto")
    sdk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
    finished = 0
    for name, question in prompts()[::5]:  # two per schema
        schema = SCHEMAS[name]
        out = sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        text = out.choices[0].message.content
        if out.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            finished += 1
        else:  # a greedy 135M model can loop inside a string until max_tokens: cut short, never invalid
            assert out.choices[0].finish_reason == "length" and text.startswith("{"), text
    assert finished >= 8
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": SCHEMAS["weather"]}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = sdk.chat.completions.create(model="m", messages=ask,
                                      tools=[weather], tool_choice="required", temperature=0, max_tokens=200)
    (call,) = out.choices[0].message.tool_calls[:1]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["weather"])
