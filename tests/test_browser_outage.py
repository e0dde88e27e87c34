"""The page through outages and slow starts, in real headless Chromium against real gunicorn servers
it may stop and start: a conversation that failed to load loads by itself once the server is back,
the reconnect is quick and can be hurried, and a page opened while the model loads learns its name."""
from __future__ import annotations

import signal
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
    return server_factory("outage", CHAT_MAX_NEW_TOKENS=30000, CHAT_CONTEXT_TOKENS=32768, CHAT_RESUME_GRACE_S=3,
                          CHAT_GRACEFUL_TIMEOUT_S=8)


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

        restartable.stop()  # SIGTERM: the server says it drains, then closes
        c.wait_until(f"() => {STATE} === 'restarting' && document.getElementById('conn-text')"
                     ".textContent.includes('retrying in')", 20)
        # An honest countdown, never far off, and a way to hurry it.
        text = c.page.text_content("#conn-text")
        assert text.startswith("Server restarting"), text
        assert "retrying in" in text and int(text.split("retrying in ")[1].split(" ")[0]) <= 5, text
        assert c.page.is_visible("[data-testid=retry-now]")
        c.shot("outage-disconnected")

        c.page.go_back()  # to the first conversation, while the server is down
        c.wait_until("() => !document.querySelector('[data-testid=error]').hidden", 20)
        assert "loads again by itself" in c.page.text_content("[data-testid=error]")
        assert c.js(USERS) == []
        # Nothing goes into a history no one can see: the message stays in the box, marked to go
        # once the conversation shows.
        c.send("Typed during the outage")
        assert "has loaded" in c.page.text_content("[data-testid=queued]")
        assert c.page.input_value("[data-testid=prompt]") == "Typed during the outage"

        restartable.start()
        c.wait_until(f"() => {STATE} === 'open'", 30)
        # The kept message goes by itself, into the history on screen, and the error line goes too.
        c.wait_until(f"() => {USERS}.length === 2", 20)
        assert c.page.url == first
        assert c.page.is_hidden("[data-testid=error]") and c.page.is_hidden("[data-testid=queued]")
        c.wait_done()
        assert c.js(USERS) == ["First topic", "Typed during the outage"]
        assert not c.errors, c.errors
    finally:
        c.close()


def test_retry_now_tries_at_once_and_the_server_is_found_back_quickly(browser, restartable):
    c = Chat(browser, restartable.url).open()
    try:
        restartable.stop()
        c.wait_until(f"() => {STATE} === 'restarting' && !document.querySelector('[data-testid=retry-now]').hidden", 20)
        c.js("""() => { window.__texts = [];
            new MutationObserver(() => window.__texts.push(document.getElementById('conn-text').textContent))
              .observe(document.querySelector('[data-testid=connection-status]'), {attributes: true}); }""")
        c.page.click("[data-testid=retry-now]")
        c.wait_until("() => window.__texts.includes('Server restarting · reconnecting…')", 5)
        restartable.start()
        started = time.monotonic()
        c.wait_until(f"() => {STATE} === 'open'", 15)
        print(f"reconnected {time.monotonic() - started:.1f} s after /readyz said ready")
    finally:
        c.close()


def test_a_restart_is_told_as_such_and_a_message_sent_meanwhile_goes_once_it_is_back(browser, restartable):
    c = Chat(browser, restartable.url, settings={"max_new_tokens": 30000}).open()
    try:
        c.js("""() => { window.__states = [];
            new MutationObserver(() => window.__states.push(""" + STATE + """))
              .observe(document.querySelector('[data-testid=connection-status]'), {attributes: true}); }""")
        c.send("A long answer, please")
        c.wait_until("() => { const m = [...document.querySelectorAll('[data-testid=message-assistant]')].pop();"
                     " return m && m.view.text.length > 0; }")
        restartable.proc.send_signal(signal.SIGTERM)  # the answer runs on while the server drains
        c.wait_until(f"() => {STATE} === 'restarting'", 10)
        assert c.page.text_content("#conn-text") == "Server restarting…"
        assert c.js("[...document.querySelectorAll('[data-testid=message-assistant]')].pop().dataset.state") != "done"
        c.shot("outage-restarting")
        c.page.click("[data-testid=stop]")  # Stop still works on the running answer
        c.wait_done(20)
        c.send("Sent while it restarts")
        queued = c.page.text_content("[data-testid=queued]")
        assert "restarting" in queued, queued
        assert c.page.is_hidden("[data-testid=error]"), c.page.text_content("[data-testid=error]")
        assert c.page.input_value("[data-testid=prompt]") == "Sent while it restarts"
        c.shot("outage-kept-message")
        assert restartable.proc.wait(30) == 0
        assert "closed" not in c.js("window.__states") and "open" not in c.js("window.__states")
        restartable.start()
        c.wait_until(f"() => {STATE} === 'open'", 30)
        c.wait_until(f"() => {USERS}.length === 2", 20)  # it went by itself
        assert c.js(USERS) == ["A long answer, please", "Sent while it restarts"]
        # The answer from before the restart still says how much of the context it used.
        assert "% of the context" in c.page.text_content("[data-testid=stats]")
        c.page.click("[data-testid=stop]")
        c.wait_done(20)
        assert c.page.is_hidden("[data-testid=error]") and c.page.is_hidden("[data-testid=queued]")
        assert c.page.input_value("[data-testid=prompt]") == ""
        assert not c.errors, c.errors
    finally:
        c.close()


def test_a_page_opened_while_the_model_loads_learns_its_name(browser, server_factory):
    port = free_port()
    srv = server_factory("slowstart", wait=False, CHAT_BACKEND="openai",
                         CHAT_BACKEND_URL=f"http://127.0.0.1:{port}/v1")
    assert until(lambda: answers(srv.url + "/healthz"), timeout=60)
    c = Chat(browser, srv.url)
    failed = []  # every request that failed or answered 4xx/5xx: following readiness must add none
    c.page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    c.page.on("console", lambda m: failed.append(m.text) if m.type == "error" else None)
    c.open()
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
        assert not failed, failed
    finally:
        c.close()
        if upstream is not None:
            upstream.shutdown()
