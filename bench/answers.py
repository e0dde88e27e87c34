"""Answers programs can rely on, counted on the bundled model through a real server and the OpenAI SDK:
``json_object`` and a two-field ``json_schema`` at max_tokens 40, 80 and 120 (every answer must parse
and validate), and named and required tool choices streamed (each exactly one call whose arguments
parse and validate), all at the server's default sampling.

``.venv/bin/python -m bench.answers [RUNS [FRONT]]`` (RUNS per case, default 100) prints one JSON line;
CHAT_* variables reach the server (the bundled model by default). FRONT: ``self`` runs the cases
through a server with ``CHAT_BACKEND=openai`` in front of a second instance (the real engine), ``llama``
in front of llama.cpp's server with ``--jinja`` on the bundled GGUF, or the ``.gguf`` file ``CHAT_MODEL`` names
(``LLAMA_SERVER`` names the binary).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CLIENTS = 8
FRUITS = [{"role": "user", "content": "List two fruits as JSON."}]
PAIR = {"type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}},
        "required": ["name", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


def _json_case(sdk, fmt: dict, max_tokens: int, schema: dict | None) -> dict:
    out = sdk.chat.completions.create(model="m", messages=FRUITS, response_format=fmt, max_tokens=max_tokens)
    choice = out.choices[0]
    try:
        value = json.loads(choice.message.content)
        ok = isinstance(value, dict)
        if schema is not None:
            import jsonschema
            jsonschema.validate(value, schema)
    except Exception:  # any failure counts
        ok = False
    return {"ok": ok, "finish": choice.finish_reason, "tokens": out.usage.completion_tokens,
            "text": None if ok else choice.message.content}


def _tool_case(sdk, choice, max_tokens: int) -> dict:
    stream = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                         max_tokens=max_tokens, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for d in c.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or (d.function.name if d.function else None)
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = c.finish_reason or finish
    ok = len(calls) == 1 and finish == "tool_calls"
    if ok:
        call = calls[0]
        want = "get_weather" if isinstance(choice, dict) else None
        try:
            args = json.loads(call["arguments"])
            tool = WEATHER if call["name"] == "get_weather" else TIME
            import jsonschema
            jsonschema.validate(args, tool["function"]["parameters"])
            ok = bool(call["id"]) and (want is None or call["name"] == want)
        except Exception:
            ok = False
    return {"ok": ok, "finish": finish, "calls": len(calls), "text": None if ok else json.dumps(calls)}


def cases(runs: int) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for max_tokens in (40, 80, 120):
        out += [(f"json_object@{max_tokens}", (_json_case, {"type": "json_object"}, max_tokens, None))] * runs
        fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": PAIR, "strict": True}}
        out += [(f"json_schema@{max_tokens}", (_json_case, fmt, max_tokens, PAIR))] * runs
    named = {"type": "function", "function": {"name": "get_weather"}}
    out += [("tool_named@80", (_tool_case, named, 80))] * runs
    out += [("tool_required@80", (_tool_case, "required", 80))] * runs
    return out


def run(url: str, runs: int) -> dict:
    import openai
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    todo = cases(runs)
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda c: (c[0], c[1][0](sdk, *c[1][1:])), todo))
    report: dict = {"runs": runs, "seconds": round(time.monotonic() - started, 1), "cases": {}}
    for name, result in results:
        case = report["cases"].setdefault(name, {"ok": 0, "failed": 0, "finish": {}, "examples": []})
        case["ok" if result["ok"] else "failed"] += 1
        case["finish"][result["finish"]] = case["finish"].get(result["finish"], 0) + 1
        if not result["ok"] and len(case["examples"]) < 3:
            case["examples"].append(result["text"])
    return report


def main() -> None:
    import os

    from harness import LiveServer
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    front = sys.argv[2] if len(sys.argv) > 2 else "local"
    stops = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CHAT_DB": f"{tmp}/chat.db", "CHAT_MAX_BATCH": CLIENTS, "CHAT_RATE_LIMIT_PER_IP_PER_MIN": 0}
        try:
            if front == "self":
                engine = LiveServer(Path(tmp) / "engine", {**env, "CHAT_DB": f"{tmp}/engine.db"}, ready_timeout=600)
                stops.append(engine.stop)
                env.update(CHAT_BACKEND="openai", CHAT_BACKEND_URL=f"{engine.url}/v1")
            elif front == "llama":
                from chat.engine.model.loader import bundled_gguf

                from .peer import LlamaServer
                model = os.environ.get("CHAT_MODEL") or str(bundled_gguf())
                llama = LlamaServer(os.environ["LLAMA_SERVER"], model, Path(tmp))
                llama.cmd.append("--jinja")
                llama.start()
                stops.append(llama.stop)
                env.update(CHAT_BACKEND="openai", CHAT_BACKEND_URL=f"http://127.0.0.1:{llama.port}/v1")
            server = LiveServer(Path(tmp), env, ready_timeout=600)
            stops.append(server.stop)
            print(json.dumps({"front": front, **run(server.url, runs)}))
        finally:
            for stop in reversed(stops):
                stop()


if __name__ == "__main__":
    main()
