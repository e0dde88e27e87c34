"""Nothing deleted by one slip, in real headless Chromium against the live gunicorn server: Delete moves
a chat to the trash with Undo, Archive takes it out of the list whole, the Archived and Trash lists
bring chats back, and Select ticks several to archive, delete or export at once."""
from __future__ import annotations

import json

TITLES = "[...document.querySelectorAll('[data-testid=conversation-item] .conversation-title')].map(e => e.textContent)"


def chats(c, *texts):
    for text in texts:
        c.page.click("[data-testid=new-chat]")
        c.send(text)
        c.wait_done()
    c.wait_until(f"() => {TITLES}.length === {len(texts)}")


def row(title: str) -> str:
    return f"[data-testid=conversation-item]:has(.conversation-title:text-is('{title}'))"


def menu(c, title: str, action: str) -> None:
    c.page.hover(row(title))
    c.page.click(f"{row(title)} [data-action=menu]")
    c.page.click(f"[data-testid=menu-{action}]")


def test_delete_goes_to_the_trash_and_undo_brings_it_back_open(chat):
    c = chat(settings={"max_new_tokens": 6})
    chats(c, "Owls at night", "Bread at dawn")
    address = c.page.url
    menu(c, "Bread at dawn", "delete")
    c.wait_until(f"() => JSON.stringify({TITLES}) === JSON.stringify(['Owls at night'])")
    assert c.dialogs == []
    assert c.page.text_content("#toast-text") == "“Bread at dawn” moved to the trash."
    assert c.page.locator("[data-testid=message-user]").count() == 0  # the open chat gave way
    c.shot("trash-toast")
    c.page.click("[data-testid=toast-undo]")
    c.wait_until(f"() => {TITLES}.length === 2")
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 1")
    assert c.page.url == address and c.page.text_content("#chat-title") == "Bread at dawn"
    assert c.page.is_hidden("[data-testid=toast]")

    # From the Trash list: restore, or delete for good.
    menu(c, "Bread at dawn", "delete")
    menu(c, "Owls at night", "delete")
    c.wait_until(f"() => {TITLES}.length === 0")
    c.page.click("[data-testid=open-trash]")
    c.wait_until("() => document.querySelectorAll('[data-testid=library-item]').length === 2")
    assert "for 30 days" in c.page.text_content("#library-about")
    assert "Deleted" in c.page.text_content("[data-testid=library-item] time")
    c.shot("trash-list")
    item = "[data-testid=library-item]:has(.library-title:text-is('Owls at night'))"
    c.page.click(f"{item} [data-testid=library-restore]")
    c.wait_until("() => document.querySelectorAll('[data-testid=library-item]').length === 1")
    c.wait_until(f"() => JSON.stringify({TITLES}) === JSON.stringify(['Owls at night'])")
    c.page.click("[data-testid=library-purge]")  # asks first (accepted by the driver)
    c.wait_until("() => !document.querySelector('[data-testid=library-empty]').hidden")
    assert any("for good" in d for d in c.dialogs)
    listed = c.page.request.get(f"{c.url}/api/conversations?view=trash").json()
    assert listed == []
    c.page.keyboard.press("Escape")
    assert not c.errors, c.errors


def test_archive_and_select_several(chat):
    c = chat(settings={"max_new_tokens": 6})
    chats(c, "Alpha note", "Bravo note", "Charlie note", "Delta note")
    menu(c, "Delta note", "archive")
    c.wait_until(f"() => {TITLES}.length === 3")
    assert c.page.text_content("#toast-text") == "“Delta note” archived."
    c.page.click("[data-testid=open-archived]")
    c.wait_until("() => document.querySelectorAll('[data-testid=library-item]').length === 1")
    c.page.click("[data-testid=library-open]")  # an archived chat still opens and answers
    c.wait_until("() => document.getElementById('chat-title').textContent === 'Delta note'")
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 1")

    c.page.click("[data-testid=select-mode]")
    assert c.page.is_visible("[data-testid=bulk-bar]") and c.page.is_disabled("[data-testid=bulk-delete]")
    c.page.click(f"{row('Alpha note')} .conversation-open")
    c.page.click(f"{row('Bravo note')} .conversation-open")
    assert c.page.text_content("[data-testid=bulk-count]") == "2 selected"
    assert c.page.get_attribute(f"{row('Alpha note')} .conversation-open", "aria-checked") == "true"
    assert c.page.get_attribute(f"{row('Charlie note')} .conversation-open", "aria-checked") == "false"
    c.shot("select-several")
    with c.page.expect_download() as download:
        c.page.click("[data-testid=bulk-export]")
    bundle = json.loads(open(download.value.path()).read())
    assert sorted(conv["title"] for conv in bundle["conversations"]) == ["Alpha note", "Bravo note"]
    c.page.click("[data-testid=bulk-delete]")
    c.wait_until(f"() => JSON.stringify({TITLES}) === JSON.stringify(['Charlie note'])")
    assert c.page.text_content("#toast-text") == "2 chats moved to the trash."
    assert c.page.is_hidden("[data-testid=bulk-bar]")
    c.page.click("[data-testid=toast-undo]")
    c.wait_until(f"() => {TITLES}.length === 3")
    assert not c.errors, c.errors
