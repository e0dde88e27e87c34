"""The page through outages and slow starts, in real headless Chromium against real gunicorn servers
it may stop and start: a conversation that failed to load loads by itself once the server is back,
the reconnect is quick and can be hurried, and a page opened while the model loads learns its name."""
from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from helpers import UPSTREAM_MODELS, Chat, Upstream, free_port, http_get, until

USERS = "[...document.querySelectorAll('[data-testid=message-user] .msg-body')].map(e => e.textContent)"
STATE = "document.querySelector('[data-testid=connection-status]').dataset.state"


def answers(url: str) -> bool:
    try:
        return http_get(url, timeout=2)[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def restartable(server_factory):
    """A server of this module's own, to stop and start."""
    return server_factory("outage", CHAT_MAX_NEW_TOKENS=64, CHAT_RESUME_GRACE_S=3)


def test_a_conversation_that_failed_to_load_loads_once_the_server_is_back(browser, restartable):
    c = Chat(browser, restartable.url, settings={"max_new_tokens": 8}).open()
    try:
        c.send("First topic")
        c.wait_done()
        first = c.page.url
        c.page.click("[data-testid=new-chat]")
        c.send("Second topic")
        c.wait_done()
        c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 2")

        restartable.stop()
        c.wait_until(f"() => {STATE} === 'closed'", 20)
        # An honest countdown, never far off, and a way to hurry it.
        text = c.page.text_content("#conn-text")
        assert "retrying in" in text and int(text.split("retrying in ")[1].split(" ")[0]) <= 5, text
        assert c.page.is_visible("[data-testid=retry-now]")
        c.shot("outage-disconnected")

        c.page.go_back()  # to the first conversation, while the server is down
        c.wait_until("() => !document.querySelector('[data-testid=error]').hidden", 20)
        assert "loads again by itself" in c.page.text_content("[data-testid=error]")
        assert c.js(USERS) == []
        # Nothing goes into a history no one can see: the message stays in the box.
        c.send("Typed during the outage")
        assert "has not loaded yet" in c.page.text_content("[data-testid=error]")
        assert c.page.input_value("[data-testid=prompt]") == "Typed during the outage"

        restartable.start()
        c.wait_until(f"() => {STATE} === 'open'", 30)
        c.wait_until(f"() => JSON.stringify({USERS}) === JSON.stringify(['First topic'])", 20)
        assert c.page.url == first
        assert c.page.is_hidden("[data-testid=error]")
        c.page.keyboard.press("Enter")  # the kept message goes now, into the history on screen
        c.wait_until(f"() => {USERS}.length === 2")
        c.wait_done()
        assert c.js(USERS) == ["First topic", "Typed during the outage"]
        assert not c.errors, c.errors
    finally:
        c.close()


def test_retry_now_tries_at_once_and_the_server_is_found_back_quickly(browser, restartable):
    c = Chat(browser, restartable.url).open()
    try:
        restartable.stop()
        c.wait_until(f"() => {STATE} === 'closed'", 20)
        c.js("""() => { window.__states = [];
            new MutationObserver(() => window.__states.push(""" + STATE + """))
              .observe(document.querySelector('[data-testid=connection-status]'), {attributes: true}); }""")
        c.page.click("[data-testid=retry-now]")
        c.wait_until("() => window.__states.includes('connecting')", 5)
        restartable.start()
        started = time.monotonic()
        c.wait_until(f"() => {STATE} === 'open'", 15)
        print(f"reconnected {time.monotonic() - started:.1f} s after /readyz said ready")
    finally:
        c.close()


def test_a_page_opened_while_the_model_loads_learns_its_name(browser, server_factory):
    port = free_port()
    srv = server_factory("slowstart", wait=False, CHAT_BACKEND="openai",
                         CHAT_BACKEND_URL=f"http://127.0.0.1:{port}/v1")
    assert until(lambda: answers(srv.url + "/healthz"), timeout=60)
    c = Chat(browser, srv.url).open()
    upstream = None
    try:
        c.wait_until("() => document.querySelector('[data-testid=model-name]').textContent"
                     " === 'Model unavailable'", 20)
        c.shot("model-unavailable")
        handler = type("Handler", (Upstream,), {"models": list(UPSTREAM_MODELS), "asked": []})
        upstream = ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=upstream.serve_forever, daemon=True).start()
        c.wait_until(f"() => document.querySelector('[data-testid=model-name]').textContent"
                     f" === '{UPSTREAM_MODELS[0]}'", 30)
        c.page.click("#open-settings")
        assert c.page.text_content("#settings-model") == UPSTREAM_MODELS[0]
        assert not c.errors, c.errors
    finally:
        c.close()
        if upstream is not None:
            upstream.shutdown()
