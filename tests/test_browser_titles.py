"""Titles in real headless Chromium against the live gunicorn server and its tiny model: a new chat
shows its first words, then the title the model wrote after the first answer, whole on hover; one
title whatever version of the first message is shown."""
from __future__ import annotations

import json

import pytest

from helpers import Chat, http_get

ITEM_TITLE = "document.querySelector('[data-testid=conversation-item] .conversation-title').textContent"
ITEM_HOVER = "document.querySelector('[data-testid=conversation-item] .conversation-open').title"
TOP = "document.getElementById('chat-title')"


def stored_title(c, conv: str) -> str:
    cookie = "; ".join(f"{k['name']}={k['value']}" for k in c.context.cookies())
    return json.loads(http_get(f"{c.url}/api/conversations/{conv}", headers={"Cookie": cookie})[2])["title"]


@pytest.fixture(scope="module")
def titled(server_factory):
    """A server of this module's own, with model-written titles (CHAT_TITLES, on by default; the other live
    test servers turn them off)."""
    return server_factory("titles", CHAT_TITLES="on")


@pytest.fixture
def chat(browser, titled):
    pages = []

    def open_chat(**options) -> Chat:
        pages.append(Chat(browser, titled.url, **options))
        return pages[-1].open()
    yield open_chat
    for c in pages:
        c.close()
        assert not c.errors, c.errors


def test_a_new_chat_gets_the_models_title_after_its_first_answer(chat):
    c = chat(settings={"max_new_tokens": 12})
    c.js("""() => { window.__titles = [];
        new MutationObserver(() => { const t = document.querySelector(
            '[data-testid=conversation-item] .conversation-title'); if (t) window.__titles.push(t.textContent); })
          .observe(document.getElementById('conversation-list'), {subtree: true, childList: true,
                                                                 characterData: true}); }""")
    first = "Write one sentence about the owls that live in the old barn behind the farmhouse"
    c.send(first)
    c.wait_done()
    conv = c.page.url.rsplit("/", 1)[1]
    # The model's title arrives after the answer, without a reload; the first words were shown until then.
    # (The first words may show cut short, "…", by the server's list meanwhile.)
    c.wait_until(f"() => !{ITEM_TITLE}.startsWith({json.dumps(first[:20])})", 30)
    title = stored_title(c, conv)
    assert title and title != first
    assert c.js(ITEM_TITLE) == title and c.js(f"{TOP}.textContent") == title
    assert c.js(ITEM_HOVER) == title and c.js(f"{TOP}.title") == title  # whole on hover
    assert c.js("window.__titles")[0].startswith(first[:20])
    c.shot("title-written")

    # Editing the first message keeps the one title, on either version.
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=message-user] >> [data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "Something else entirely")
    c.page.keyboard.press("Enter")
    c.wait_done()
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 1")
    assert stored_title(c, conv) == title and c.js(f"{TOP}.textContent") == title
    c.page.click("[data-action=version-prev]")
    c.wait_until("() => document.querySelector('[data-testid=message-user] .msg-body').textContent"
                 f" === {json.dumps(first)}")
    assert c.js(f"{TOP}.textContent") == title
