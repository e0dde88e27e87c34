"""A thinking model on the page, in real headless Chromium against a live gunicorn: the "Thinking" block open
while it thinks, closed with its duration once the answer begins, kept on reload; Stop inside the thinking;
the switch (shown only for a model whose template thinks) per new chat and per conversation. The thinking model
is a scripted upstream (no real one is here); the switch's server is the local engine on a tiny GGUF with Qwen3's
template."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Chat, ThinkingUpstream, start_upstream

ANSWER = "It is **true**: 2 < 3."
THOUGHT = "The user asks; let me think. 2 < 3 is true."
BLOCK = ("[...document.querySelectorAll('[data-testid=message-assistant]')].pop()"
         "?.querySelector('[data-testid=thinking-block]')")


@pytest.fixture(scope="module")
def thinker(server_factory):
    handler = type("Handler", (ThinkingUpstream,), {"asked": [], "delay": 0.3})
    upstream = start_upstream(handler)
    srv = server_factory("thinker-page", CHAT_BACKEND="openai",
                         CHAT_BACKEND_URL=f"http://127.0.0.1:{upstream.server_port}/v1")
    yield srv
    upstream.shutdown()
    upstream.server_close()


def block(c) -> dict | None:
    return c.js(f"""() => {{ const b = {BLOCK}; return b && {{ open: b.open, state: b.dataset.state || '',
        label: b.querySelector('[data-testid=thinking-label]').textContent,
        text: b.querySelector('[data-testid=thinking-text]').textContent }}; }}""")


def test_the_thinking_block_opens_while_thinking_and_closes_with_its_duration(browser, thinker):
    c = Chat(browser, thinker.url).open()
    try:
        assert c.page.is_hidden("[data-testid=thinking-toggle]")  # a remote model: no switch offered
        c.send("Is 2 < 3?")
        c.wait_until(f"() => {{ const b = {BLOCK}; return b && b.open && b.dataset.state === 'thinking'"
                     " && b.textContent.includes('let me'); }")
        live = block(c)
        assert live["label"].startswith("Thinking…") and c.answer() == ""
        c.shot("thinking-open")
        assert c.wait_done() == "stop"
        done = block(c)
        assert done["open"] is False and done["state"] == "done" and done["text"] == THOUGHT
        assert done["label"].startswith("Thought for ") and done["label"].endswith(" s")
        assert c.answer() == ANSWER
        body = c.js("[...document.querySelectorAll('.msg-assistant .msg-body')].pop().textContent")
        assert "2 < 3 is true" not in body  # the thinking is not in the answer
        c.shot("thinking-closed")
        c.page.click("[data-testid=thinking-block] summary")  # it opens on demand
        assert block(c)["open"] is True
        c.page.reload()
        c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
        c.wait_until(f"() => {BLOCK}")
        again = block(c)
        assert again["open"] is False and again["text"] == THOUGHT and again["label"] == done["label"]
        c.shot("thinking-reloaded")
        assert c.errors == []
    finally:
        c.close()


def test_stop_inside_the_thinking_keeps_it_open_and_shown(browser, thinker):
    c = Chat(browser, thinker.url).open()
    try:
        c.send("Think long about it.")
        c.wait_until(f"() => {{ const b = {BLOCK}; return b && b.textContent.includes('Step 0. 1.'); }}")
        c.page.click("[data-testid=stop]")
        assert c.wait_done() == "cancelled"
        stopped = block(c)
        assert stopped["open"] is True and stopped["text"].startswith("Step 0. 1.")
        assert stopped["label"].startswith("Thought for ")
        c.shot("thinking-stopped")
        assert c.errors == []
    finally:
        c.close()


@pytest.fixture(scope="module")
def qwen3_server(server_factory):
    from tinygguf import tiny_gguf
    template = (Path(__file__).resolve().parent / "templates" / "qwen3.jinja").read_text()
    return server_factory("qwen3-page", CHAT_MODEL=str(tiny_gguf(template=template)), CHAT_MAX_NEW_TOKENS=8)


def test_the_switch_is_offered_for_a_thinking_model_per_new_chat_and_per_conversation(browser, qwen3_server):
    c = Chat(browser, qwen3_server.url).open()
    toggle = "[data-testid=thinking-toggle]"
    try:
        c.page.wait_for_selector(toggle)
        assert c.page.get_attribute(toggle, "aria-pressed") == "true"
        c.page.click(toggle)  # off for new chats
        assert c.page.get_attribute(toggle, "aria-pressed") == "false"
        assert c.page.inner_text(toggle) == "Thinking off"
        c.send("Hello")
        c.wait_done()
        conv = c.js("location.pathname.split('/').pop()")
        stored = lambda: c.page.request.get(f"{c.url}/api/conversations/{conv}").json()  # noqa: E731
        assert stored()["params"]["enable_thinking"] is False
        c.shot("thinking-switch-off")
        c.page.click(toggle)  # this conversation's own setting: on
        c.wait_until(f"() => document.querySelector('{toggle}').getAttribute('aria-pressed') === 'true'")
        assert stored()["params"]["enable_thinking"] is True
        c.page.goto(qwen3_server.url + "/")
        c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
        c.wait_until(f"() => document.querySelector('{toggle}').getAttribute('aria-pressed') === 'false'")
        assert c.errors == []
    finally:
        c.close()
    phone = Chat(browser, qwen3_server.url, width=375, height=740).open()
    try:  # on a phone the switch fits the top bar beside the title and the menu
        phone.page.wait_for_selector(toggle)
        box = phone.page.locator(toggle).bounding_box()
        assert box is not None and box["x"] + box["width"] <= 375
        phone.shot("thinking-switch-phone")
    finally:
        phone.close()
