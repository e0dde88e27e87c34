"""What users of other chat UIs reach for, in real headless Chromium against the live gunicorn server:
starter prompts, message times on hover and dates in search results, a theme switch and text size kept
per browser (axe-core still finds nothing serious in the theme chosen)."""
from __future__ import annotations

import time

from helpers import Chat
from test_browser_keyboard import AXE, axe_violations

BG = "getComputedStyle(document.body).backgroundColor"


def test_a_starter_prompt_starts_a_chat(chat):
    c = chat(settings={"max_new_tokens": 6})
    starters = c.js("[...document.querySelectorAll('[data-testid=starter]')].map(b => b.textContent)")
    assert len(starters) == 4 and all(len(s) < 80 for s in starters), starters
    c.page.click("[data-testid=starter] >> nth=1")
    c.wait_done()
    assert c.page.text_content("[data-testid=message-user] .msg-body") == starters[1]
    assert c.page.is_hidden("[data-testid=starters]")  # the empty screen is gone
    phone = chat(width=375)  # one column there, inside the screen
    assert phone.js("[...document.querySelectorAll('[data-testid=starter]')]"
                    ".every(b => b.getBoundingClientRect().right <= innerWidth)")


def test_message_times_on_hover_and_dates_in_search_results(chat):
    c = chat(settings={"max_new_tokens": 6})
    before = time.time()
    c.send("Remember the lighthouse keeper")
    c.wait_done()
    c.wait_until("() => document.querySelectorAll('[data-testid=message-time]').length === 2")
    stamps = c.js("[...document.querySelectorAll('[data-testid=message-time]')]"
                  ".map(t => Date.parse(t.dateTime) / 1000)")
    assert all(before - 2 < at < time.time() + 2 for at in stamps), (before, stamps)
    user_time = "[data-testid=message-user] [data-testid=message-time]"
    assert c.js(f"getComputedStyle(document.querySelector('{user_time}')).opacity") == "0"
    c.page.hover("[data-testid=message-user]")
    c.wait_until(f"() => getComputedStyle(document.querySelector('{user_time}')).opacity === '1'", 5)
    assert c.page.get_attribute(user_time, "title")  # the full date and time
    c.shot("message-time")
    c.page.fill("[data-testid=search]", "lighthouse")
    c.page.wait_for_selector("[data-testid=search-hit]")
    date = c.page.get_attribute("[data-testid=search-hit] [data-testid=hit-date]", "datetime")
    assert before - 2 < time.mktime(time.strptime(date[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone < time.time() + 2
    c.shot("search-dates")


def test_theme_and_text_size_are_kept_in_this_browser(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    context.add_init_script(path=str(AXE))
    context.add_init_script("localStorage.setItem('chat.settings', JSON.stringify({max_new_tokens: 8}))")
    c = Chat(browser, server.url, context=context)
    try:
        c.open()
        light = c.js(BG)
        size = c.js("parseFloat(getComputedStyle(document.body).fontSize)")
        c.page.click("[data-testid=open-settings]")
        c.page.select_option("[data-testid=set-theme]", "dark")
        c.page.select_option("[data-testid=set-text]", "large")
        assert c.js(BG) != light and c.js("document.documentElement.dataset.theme") == "dark"
        assert c.js("parseFloat(getComputedStyle(document.body).fontSize)") > size
        assert c.js("document.getElementById('hl-dark').media") == "all"
        c.page.keyboard.press("Escape")
        c.page.reload()  # kept: drawn dark from the first paint
        c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
        assert c.js(BG) != light and c.js("parseFloat(getComputedStyle(document.body).fontSize)") > size
        c.send("Check **this** `code`")
        c.wait_done()
        assert axe_violations(c) == []
        c.shot("theme-dark-large")
        c.page.click("[data-testid=open-settings]")
        assert c.page.input_value("[data-testid=set-theme]") == "dark"
        c.page.select_option("[data-testid=set-theme]", "system")
        c.page.select_option("[data-testid=set-text]", "default")
        assert c.js(BG) == light and c.js("parseFloat(getComputedStyle(document.body).fontSize)") == size
        assert not c.errors, c.errors
    finally:
        context.close()


def test_branch_into_a_new_chat_from_any_message(chat):
    c = chat(settings={"max_new_tokens": 6})
    c.send("First question")
    c.wait_done()
    c.send("Second question")
    c.wait_done()
    original = c.page.url
    c.wait_until("() => document.querySelector('[data-testid=message-assistant]').dataset.id")
    c.page.hover("[data-testid=message-assistant] >> nth=0")
    c.page.click("[data-testid=message-assistant] >> nth=0 >> [data-testid=branch]")
    c.wait_until(f"() => location.href !== {original!r}")
    c.wait_until("() => document.querySelectorAll('.msg').length === 2")
    assert c.page.text_content("#chat-title") == "First question (branch)"
    assert c.js("[...document.querySelectorAll('[data-testid=message-user] .msg-body')].map(e => e.textContent)") \
        == ["First question"]
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 2")
    c.shot("branched")
    # The new chat goes on by itself; the original keeps its four messages.
    c.send("A different follow-up")
    c.wait_done()
    c.page.goto(original)
    c.wait_until("() => document.querySelectorAll('.msg').length === 4")


def test_edit_an_answer_as_a_new_version(chat):
    c = chat(settings={"max_new_tokens": 6})
    c.send("Say something")
    c.wait_done()
    original = c.answer()
    c.wait_until("() => document.querySelector('[data-testid=message-assistant]').dataset.id")
    c.page.click("[data-testid=edit-answer]")
    c.page.fill("[data-testid=edit-box]", "My own answer,\n\nin **two** paragraphs.")
    c.page.keyboard.press("Enter")  # a new line in an answer, not a save
    assert c.page.locator("[data-testid=edit-box]").count() == 1
    c.page.keyboard.press("Control+Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '2/2'")
    assert c.answer() == "My own answer,\n\nin **two** paragraphs."  # the new line typed last is trimmed
    assert c.js("document.querySelector('[data-testid=message-assistant] .msg-body strong').textContent") == "two"
    assert c.page.text_content("[data-testid=done-reason]") == "Edited by you"
    c.shot("answer-edited")
    c.page.click("[data-action=version-prev]")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '1/2'")
    assert c.answer() == original
