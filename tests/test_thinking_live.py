"""A thinking model end to end through a real gunicorn (gevent worker): its thinking on delta frames of their own
over a real WebSocket, stored with the answer and shown after a restart, sent back as the template wants, the
per-conversation switch, Stop inside the thinking, and /v1's ``reasoning_content`` read by the OpenAI SDK. The
model is a scripted upstream that thinks as Qwen3 does, cut in awkward places (no real thinking model is here)."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from helpers import WS, ThinkingUpstream, conv_of, cookie_for, start_upstream, text_of

openai = pytest.importorskip("openai")

ANSWER = "It is **true**: 2 < 3."
THOUGHT = "The user asks; let me think. 2 < 3 is true."


@pytest.fixture(scope="module")
def thinker(server_factory):
    handler = type("Handler", (ThinkingUpstream,), {"asked": []})
    upstream = start_upstream(handler)
    srv = server_factory("thinker", CHAT_BACKEND="openai", CHAT_BACKEND_URL=f"http://127.0.0.1:{upstream.server_port}/v1")
    yield srv, handler
    upstream.shutdown()
    upstream.server_close()


def stored(srv, cookie, conv):
    req = urllib.request.Request(f"{srv.url}/api/conversations/{conv}", headers={"Cookie": cookie})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def thought_of(frames) -> str:
    deltas = sorted((f for f in frames if f["type"] == "delta"), key=lambda f: f["index"])
    return "".join(f.get("reasoning", "") for f in deltas)


def test_thinking_streams_apart_is_stored_and_survives_a_restart(thinker):
    srv, handler = thinker
    cookie = cookie_for(srv)
    ws = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
    try:
        frames = ws.chat("Is 2 < 3?")
        deltas = [f for f in frames if f["type"] == "delta"]
        assert thought_of(frames) == THOUGHT and text_of(frames) == ANSWER
        assert all(not (f["text"] and f.get("reasoning")) for f in deltas)  # each frame one or the other
        first_text = next(i for i, f in enumerate(deltas) if f["text"])
        assert all(f.get("reasoning") for f in deltas[:first_text]) and not any(
            f.get("reasoning") for f in deltas[first_text:])
        done = frames[-1]
        assert done["type"] == "done" and done["reason"] == "stop" and done["timings"]["thinking_ms"] > 0
        conv = conv_of(frames)
        # a second socket resuming the finished answer from 0 gets the thinking too
        other = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
        other.send({"type": "resume", "id": "r1", "from": 0})
        replay = other.until(lambda f: f["type"] == "done")
        assert thought_of(replay) == THOUGHT and text_of(replay) == ANSWER
        other.close()
        # the next turn: the history carries the earlier thinking as reasoning_content (the template decides)
        ws.chat("And 3 < 2?", rid="r2", conversation_id=conv)
        earlier = handler.asked[-1]["messages"]
        assert {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT} in earlier
    finally:
        ws.close()
    srv.restart()
    answer = stored(srv, cookie, conv)["messages"][1]
    assert answer["content"] == ANSWER and answer["reasoning"] == THOUGHT
    assert answer["timings"]["thinking_ms"] == done["timings"]["thinking_ms"]


def test_the_switch_per_request_and_per_conversation_and_no_think(thinker):
    srv, handler = thinker
    cookie = cookie_for(srv)
    ws = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
    try:
        assert ws.ready.get("thinking") is None  # a remote model: the server cannot tell from its template
        frames = ws.chat("Is 2 < 3?", params={"enable_thinking": False})
        assert handler.asked[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        assert thought_of(frames) == "" and text_of(frames) == "Plainly: true."
        conv = conv_of(frames)
        assert stored(srv, cookie, conv)["params"]["enable_thinking"] is False
        assert "reasoning" not in stored(srv, cookie, conv)["messages"][1]
        ws.chat("Again?", rid="r2", conversation_id=conv)  # the conversation's setting holds
        assert handler.asked[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        frames = ws.chat("Is 2 < 3? /no_think", rid="r3")  # Qwen3's own switch, in the question
        assert "chat_template_kwargs" not in handler.asked[-1]
        assert thought_of(frames) == "" and text_of(frames) == "Plainly: true."
        bad = ws.chat("x", rid="r4", params={"enable_thinking": "no"})[-1]
        assert bad["type"] == "error" and bad["code"] == "bad_message" and "enable_thinking" in bad["message"]
        assert ws.ping()["t"] == 7
    finally:
        ws.close()


def test_stop_inside_the_thinking_keeps_it(thinker):
    srv, _ = thinker
    cookie = cookie_for(srv)
    ws = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
    try:
        ws.send({"type": "chat", "id": "s1", "content": "Think long about it."})
        first = ws.until(lambda f: f["type"] == "delta" and f.get("reasoning") and f["index"] >= 5)
        ws.send({"type": "cancel", "id": "s1"})
        frames = ws.until(lambda f: f["type"] == "done" and f["id"] == "s1")
        assert frames[-1]["reason"] == "cancelled" and "thinking_ms" in frames[-1]["timings"]
        conv = conv_of(first)
        streamed = thought_of(first + frames)
    finally:
        ws.close()
    answer = stored(srv, cookie, conv)["messages"][1]
    assert answer["reason"] == "cancelled" and answer["content"] == ""
    assert answer["reasoning"] == streamed and answer["reasoning"].startswith("Step 0. 1. 2. 3.")


def test_v1_returns_reasoning_content_that_the_openai_sdk_reads(thinker):
    srv, handler = thinker
    sdk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Is 2 < 3?"}]
    whole = sdk.chat.completions.create(model="m", messages=ask).choices[0].message
    assert whole.content == ANSWER and whole.reasoning_content == THOUGHT  # type: ignore[attr-defined]
    chunks = [c.choices[0].delta for c in sdk.chat.completions.create(model="m", messages=ask, stream=True)
              if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == THOUGHT
    assert "".join(d.content or "" for d in chunks) == ANSWER
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in chunks)
    off = sdk.chat.completions.create(model="m", messages=ask,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert handler.asked[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert off.choices[0].message.content == "Plainly: true."
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="m", messages=ask,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": 1}})
    assert "chat_template_kwargs.enable_thinking" in str(err.value)
    sdk.chat.completions.create(model="m", messages=ask, extra_body={"enable_thinking": False})  # top level too
    assert handler.asked[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    # an assistant turn's reasoning_content goes back to the model as the client sent it
    sdk.chat.completions.create(model="m", messages=[*ask, {"role": "assistant", "content": "Yes.",
                                                            "reasoning_content": "Small numbers."},
                                                     {"role": "user", "content": "Sure?"}])
    assert handler.asked[-1]["messages"][-2] == {"role": "assistant", "content": "Yes.",
                                                 "reasoning_content": "Small numbers."}


def test_the_cli_shows_the_thinking_apart_and_pipes_only_the_answer(thinker):
    import subprocess
    import sys
    srv, handler = thinker
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "chat.client", "--url", srv.ws_url, "Is 2 < 3?"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ANSWER + "\n"  # a pipe gets the answer alone
    assert f"Thinking…\n{THOUGHT}\n…done thinking." in run.stderr
    hidden = subprocess.run([sys.executable, "-m", "chat.client", "--url", srv.ws_url, "--hide-thinking",
                             "--thinking", "off", "Is 2 < 3?"], cwd=root, capture_output=True, text=True, timeout=60)
    assert hidden.returncode == 0 and hidden.stdout == "Plainly: true.\n" and "Thinking" not in hidden.stderr
    assert handler.asked[-1]["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_local_engine_through_gunicorn_answers_inside_the_thinking_its_template_opened(server_factory):
    """The own decoder on a tiny GGUF with an R1-style template (its prompt opens <think>): the tiny random
    model never closes it, so its whole answer, cut by its budget, is thinking: on the WebSocket, stored, and on
    /v1 as reasoning_content the SDK reads."""
    from tinygguf import tiny_gguf
    template = (Path(__file__).resolve().parent / "templates" / "r1.jinja").read_text()
    srv = server_factory("r1-local", CHAT_MODEL=str(tiny_gguf(template=template)), CHAT_MAX_NEW_TOKENS=16)
    cookie = cookie_for(srv)
    ws = WS(srv.ws_url, header=[f"Cookie: {cookie}"])
    try:
        assert ws.ready["thinking"] is True
        frames = ws.chat("Hello", params={"temperature": 0, "max_new_tokens": 10})
        done = frames[-1]
        assert done["reason"] == "length" and done["usage"]["completion_tokens"] == 10
        thought = thought_of(frames)
        assert thought and text_of(frames) == ""
        answer = stored(srv, cookie, conv_of(frames))["messages"][1]
        assert answer["reasoning"] == thought and answer["content"] == ""
    finally:
        ws.close()
    sdk = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    whole = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=10,
                                        temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    assert whole.choices[0].message.reasoning_content and not whole.choices[0].message.content  # type: ignore[attr-defined]
