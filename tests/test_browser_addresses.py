"""Addresses and settings that say what they do, in real headless Chromium against the live gunicorn
server: "/" is a new chat, a dead /c/<id> bookmark says so, and settings out of range are refused
beside their field instead of being ignored or capped quietly."""
from __future__ import annotations

import pytest

CURRENT = "((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)"
SAVED = "JSON.parse(localStorage.getItem('chat.settings') || '{}')"


def test_slash_opens_a_new_chat_and_a_dead_bookmark_says_so(chat):
    c = chat(settings={"max_new_tokens": 6})
    c.send("Something to keep")
    c.wait_done()
    assert c.js(CURRENT)
    c.open("/")
    assert c.js(CURRENT) is None
    assert c.page.locator("[data-testid=message-user]").count() == 0
    c.page.wait_for_selector("[data-testid=conversation-item]")
    assert c.page.is_hidden("[data-testid=error]")

    c.open("/c/" + "0" * 32)
    c.wait_until("() => !document.querySelector('[data-testid=error]').hidden")
    assert "not found" in c.page.text_content("[data-testid=error]")
    assert c.js("location.pathname") == "/"
    assert c.page.text_content("#chat-title") == "New chat"


@pytest.mark.parametrize("width", [375, 1280])
def test_settings_out_of_range_say_so_beside_the_field(chat, width):
    c = chat(width=width, height=800)
    if width < 800:
        c.page.click("#sidebar-toggle")
    c.page.click("[data-testid=open-settings]")
    limit = c.js("Number(document.getElementById('set-max-tokens').max)")
    assert limit == 4096
    c.page.fill("#set-max-tokens", "-5")
    error = "[data-testid=max-tokens-error]"
    assert c.page.is_visible(error) and "from 1 to 4,096" in c.page.text_content(error)
    assert c.js("document.getElementById('set-max-tokens').getAttribute('aria-invalid')") == "true"
    assert c.js(SAVED).get("max_new_tokens") is None
    c.page.fill("#set-max-tokens", "99999")
    assert c.page.is_visible(error)
    assert c.js(SAVED).get("max_new_tokens") is None, "an out-of-range value was saved"
    c.page.fill("#set-seed", "-1")
    assert c.page.is_visible("[data-testid=seed-error]")
    c.shot(f"settings-invalid-{width}")
    c.page.fill("#set-max-tokens", "100")
    assert c.page.is_hidden(error)
    assert c.js("document.getElementById('set-max-tokens').hasAttribute('aria-invalid')") is False
    assert c.js(SAVED)["max_new_tokens"] == 100
    c.page.fill("#set-seed", "")
    assert c.page.is_hidden("[data-testid=seed-error]")
    assert c.js(SAVED).get("seed") is None
