"""Share links in real headless Chromium against a live gunicorn server with CHAT_SHARING on: the
owner makes a link from the conversation menu, someone else reads it (Markdown and math drawn, under
the CSP), and Stop sharing ends it. On the shared default server the menu offers no link."""
from __future__ import annotations

import json

import pytest
from helpers import Chat


@pytest.fixture(scope="module")
def sharing_server(server_factory):
    return server_factory("sharing", CHAT_SHARING="1")


def test_the_menu_offers_no_link_when_sharing_is_off(chat):
    c = chat(settings={"max_new_tokens": 4})
    c.send("Hello")
    c.wait_done()
    c.page.click("[data-testid=conversation-menu] summary")
    assert c.page.is_hidden("[data-testid=open-share]")


@pytest.mark.parametrize("width, scheme", [(1280, "light"), (375, "dark")])
def test_share_read_and_stop_sharing(browser, sharing_server, width, scheme):
    owner = Chat(browser, sharing_server.url, width=width).open()
    reader_context = browser.new_context(viewport={"width": width, "height": 800}, color_scheme=scheme)
    reader = Chat(browser, sharing_server.url, context=reader_context)
    try:
        messages = [{"role": "user", "content": "Explain <b>this</b>"},
                    {"role": "assistant", "content": "**Sure**: $a^2 + b^2 = c^2$.\n\n```python\nprint(1)\n```"}]
        conv = owner.page.request.post(f"{owner.url}/api/conversations/import", data=json.dumps({"messages": messages}),
                                       headers={"Content-Type": "application/json"}).json()["id"]
        owner.page.goto(f"{owner.url}/c/{conv}")
        owner.page.wait_for_selector("[data-testid=message-assistant]")
        owner.page.click("[data-testid=conversation-menu] summary")
        owner.page.click("[data-testid=open-share]")
        owner.wait_until("() => document.querySelector('[data-testid=share-url]').value.includes('/s/')")
        link = owner.page.input_value("[data-testid=share-url]")
        owner.shot(f"share-dialog-{width}")

        reader.page.goto(link)
        reader.page.wait_for_selector("[data-testid=shared-assistant] math")
        assert reader.page.text_content("[data-testid=shared-title]").startswith("Explain <b>this</b>")
        assert reader.page.text_content("[data-testid=shared-user] .msg-body") == "Explain <b>this</b>"
        assert reader.js("document.querySelectorAll('[data-testid=shared-thread] b').length") == 0
        assert reader.js("document.querySelector('[data-testid=shared-assistant] strong').textContent") == "Sure"
        assert reader.page.locator("[data-testid=shared-assistant] .code-block").count() == 1
        assert reader.js("document.scrollingElement.scrollHeight >= document.scrollingElement.clientHeight")
        reader.shot(f"shared-{width}-{scheme}")
        # The reader's own chat list is empty: a link shows one conversation and gives nothing else.
        assert reader.page.request.get(f"{reader.url}/api/conversations").json() == []

        owner.page.click("[data-testid=share-stop]")
        owner.wait_until("() => document.querySelector('[data-testid=share-url]').value === ''")
        reader.page.reload()
        reader.page.wait_for_selector("[data-testid=shared-missing]")
        assert not owner.errors and not reader.errors, owner.errors + reader.errors
    finally:
        owner.close()
        reader_context.close()


def test_the_shared_page_says_model_date_stopped_copies_and_continues_in_the_readers_chats(browser, sharing_server):
    owner = Chat(browser, sharing_server.url).open()
    reader_context = browser.new_context(viewport={"width": 1280, "height": 800})
    reader_context.grant_permissions(["clipboard-read", "clipboard-write"])
    reader = Chat(browser, sharing_server.url, context=reader_context)
    try:
        messages = [{"role": "user", "content": "Count for me"},
                    {"role": "assistant", "content": "One, two\n\n```text\nthree\n```", "reason": "cancelled"}]
        conv = owner.page.request.post(f"{owner.url}/api/conversations/import", data=json.dumps({"messages": messages}),
                                       headers={"Content-Type": "application/json"}).json()["id"]
        link = owner.page.request.post(f"{owner.url}/api/conversations/{conv}/share", data="{}",
                                       headers={"Content-Type": "application/json"}).json()["url"]
        reader.page.goto(sharing_server.url + link)
        reader.page.wait_for_selector("[data-testid=shared-assistant] .code-block")
        meta = reader.page.text_content("[data-testid=shared-meta]")
        assert meta.startswith("tiny-qwen") and " · " in meta and any(ch.isdigit() for ch in meta), meta
        assert reader.page.text_content("[data-testid=shared-reason]") == "Stopped"
        reader.page.click("[data-testid=shared-assistant] .copy-btn")
        reader.wait_until("() => document.querySelector('[data-testid=shared-assistant] .copy-btn')"
                          ".textContent.includes('Copied')", 5)
        assert reader.js("navigator.clipboard.readText()").strip() == "three"
        assert reader.page.text_content("[data-testid=shared-status]") == "Copied to clipboard"
        reader.shot("shared-marked")
        reader.page.click("[data-testid=shared-continue]")
        reader.page.wait_for_url("**/c/*")
        reader.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
        reader.wait_until("() => document.querySelectorAll('[data-testid=message-assistant]').length === 1")
        assert reader.page.text_content("#chat-title") == "Count for me (imported)"
        mine = reader.page.request.get(f"{reader.url}/api/conversations").json()
        assert len(mine) == 1 and mine[0]["id"] != conv  # the reader's own copy; the owner's is untouched
        assert reader.page.is_visible("[data-testid=continue]")  # a stopped answer the reader may continue
        assert not owner.errors and not reader.errors, owner.errors + reader.errors
    finally:
        owner.close()
        reader_context.close()
