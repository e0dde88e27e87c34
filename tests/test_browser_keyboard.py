"""The page by keyboard alone, in real headless Chromium against the live gunicorn server: the
sidebar is one Tab stop with arrow keys and a menu per chat, search results are reached with
arrows, focus lands somewhere sensible after every action, the phone's drawer holds focus, the
shortcuts are listed under "?", and axe-core finds no serious accessibility violations."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Chat

AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"
FOCUSED = """(() => { const a = document.activeElement; if (!a) return null;
    return a.dataset.testid || a.dataset.action || a.id || a.className || a.tagName; })()"""
ROW_FOCUSED = "document.activeElement?.closest('[data-testid=conversation-item]')?.querySelector('.conversation-title').textContent"  # noqa: E501


def tab_stops_in(c, selector: str) -> int:
    """How many Tab stops the elements under ``selector`` make."""
    return c.js(f"""[...document.querySelectorAll('{selector} button, {selector} a[href], {selector} input')]
        .filter(e => e.tabIndex >= 0 && !e.disabled && e.getClientRects().length).length""")


def three_chats(c) -> list[str]:
    titles = ["Alpha topic", "Bravo topic", "Charlie topic"]
    for i, text in enumerate(titles):
        if i:
            c.page.keyboard.press("Control+Shift+O")
        c.send(text)
        c.wait_done()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 3")
    return titles


def test_the_sidebar_is_one_tab_stop_with_arrows_and_a_menu(chat):
    c = chat(settings={"max_new_tokens": 6})
    three_chats(c)
    assert tab_stops_in(c, "#conversation-list") == 1
    # Tab from the search box lands on the open chat's row; arrows move, Enter opens.
    c.page.focus("[data-testid=search]")
    c.page.keyboard.press("Tab")
    assert c.js(ROW_FOCUSED) == "Charlie topic"
    c.page.keyboard.press("ArrowDown")
    assert c.js(ROW_FOCUSED) == "Bravo topic"
    c.page.keyboard.press("End")
    assert c.js(ROW_FOCUSED) == "Alpha topic"
    c.page.keyboard.press("Home")
    c.page.keyboard.press("ArrowDown")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=message-user] .msg-body')?.textContent === 'Bravo topic'")
    assert tab_stops_in(c, "#conversation-list") == 1

    # The row's actions on a menu: Shift+F10, arrows, Esc back to the row.
    c.page.focus("#conversation-list [tabindex='0']")
    assert c.js(ROW_FOCUSED) == "Bravo topic"
    c.page.keyboard.press("Shift+F10")
    c.wait_until("() => !document.querySelector('[data-testid=conversation-row-menu]').hidden")
    assert c.js(FOCUSED) == "menu-pin"
    c.page.keyboard.press("ArrowDown")
    assert c.js(FOCUSED) == "menu-rename"
    c.page.keyboard.press("Escape")
    assert c.js("document.querySelector('[data-testid=conversation-row-menu]').hidden")
    assert c.js(ROW_FOCUSED) == "Bravo topic"
    # Pin from the menu (→ to ⋯, Enter opens it, Enter on Pin): the row moves up, focus stays on it.
    c.page.keyboard.press("ArrowRight")
    assert c.js(FOCUSED) == "conversation-more"
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.testid === 'menu-pin'")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=conversation-item]').dataset.pinned === 'true'")
    c.wait_until(f"() => {ROW_FOCUSED} === 'Bravo topic'")
    # F2 renames in place; Delete moves it to the trash (Undo in a toast), and focus stays in the list.
    c.page.keyboard.press("F2")
    c.page.keyboard.press("End")
    c.page.keyboard.type(" renamed")
    c.page.keyboard.press("Enter")
    c.wait_until(f"() => {ROW_FOCUSED} === 'Bravo topic renamed'")
    c.page.keyboard.press("Delete")
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 2")
    c.wait_until(f"() => ['Charlie topic', 'Alpha topic'].includes({ROW_FOCUSED})")
    assert c.dialogs == [] and c.page.is_visible("[data-testid=toast-undo]")
    assert tab_stops_in(c, "#conversation-list") == 1


def test_search_results_are_reached_with_arrows(chat):
    c = chat(settings={"max_new_tokens": 6})
    three_chats(c)
    c.page.keyboard.press("Control+k")
    assert c.js(FOCUSED) == "search"
    c.page.keyboard.type("topic")
    c.wait_until("() => document.querySelectorAll('[data-testid=search-hit]').length === 3")
    c.page.keyboard.press("ArrowDown")
    assert c.js(FOCUSED) == "search-hit"
    c.page.keyboard.press("ArrowDown")
    second = c.js("document.activeElement.dataset.conversation")
    c.page.keyboard.press("ArrowUp")
    c.page.keyboard.press("ArrowUp")
    assert c.js(FOCUSED) == "search"
    c.page.keyboard.press("ArrowDown")
    c.page.keyboard.press("ArrowDown")
    c.page.keyboard.press("Enter")
    c.wait_until(f"() => location.pathname === '/c/{second}'")


def test_focus_after_regenerate_versions_and_edit(chat):
    c = chat(settings={"max_new_tokens": 6})
    c.send("Keyboard only")
    c.wait_done()
    c.page.focus("[data-action=regenerate]")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '2/2'", 30)
    c.wait_done()
    # The keyboard stays where it worked: on the new version's Regenerate (Enter again: a third).
    c.wait_until("() => document.activeElement?.dataset.action === 'regenerate' && document.activeElement"
                 ".closest('.msg') === document.querySelector('[data-testid=message-assistant]')")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '3/3'", 30)
    c.wait_done()
    c.wait_until("() => document.activeElement?.dataset.action === 'regenerate'")
    c.page.focus("[data-action=version-prev]")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '2/3'")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '1/3'")
    c.wait_until("() => document.activeElement?.dataset.action === 'version-next'")  # prev is disabled at 1/3
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '2/3'")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '3/3'")
    c.wait_until("() => document.activeElement?.dataset.action === 'version-prev'")  # next is disabled at 3/3

    c.page.focus("[data-testid=message-user] [data-action=edit]")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.testid === 'edit-box'")
    c.page.keyboard.press("Escape")
    c.wait_until("() => document.activeElement?.dataset.action === 'edit'")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.testid === 'edit-box'")
    c.page.keyboard.press("Tab")
    assert c.js(FOCUSED) == "edit-cancel"
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.action === 'edit'")
    c.page.keyboard.press("Enter")
    c.page.keyboard.type(" again")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.testid === 'prompt'")
    c.wait_done()
    # Continue (the answer was cut by the length limit): its button goes, the keyboard to the composer.
    c.page.focus("[data-testid=continue]")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.activeElement?.dataset.testid === 'prompt'")
    c.wait_done()


def test_the_phone_drawer_holds_focus(chat):
    c = chat(width=375, height=740, settings={"max_new_tokens": 6})
    c.send("On a phone")
    c.wait_done()
    c.page.click("#sidebar-toggle")
    c.wait_until("() => document.getElementById('app').classList.contains('sidebar-open')")
    assert c.js(FOCUSED) == "new-chat"
    seen = set()
    for _ in range(12):
        c.page.keyboard.press("Tab")
        seen.add(c.js("document.getElementById('sidebar').contains(document.activeElement)"))
    assert seen == {True}, "Tab left the open drawer"
    c.page.keyboard.press("Shift+Tab")
    assert c.js("document.getElementById('sidebar').contains(document.activeElement)")
    c.page.keyboard.press("Escape")
    c.wait_until("() => !document.getElementById('app').classList.contains('sidebar-open')")
    assert c.js(FOCUSED) == "sidebar-toggle"
    # One menu button per row, not four icons: the title has the room.
    c.page.click("#sidebar-toggle")
    c.wait_until("() => document.getElementById('sidebar').getBoundingClientRect().left === 0")
    width = c.js("document.querySelector('[data-testid=conversation-item] .conversation-open').getBoundingClientRect().width")  # noqa: E501
    assert width > 200, width
    c.shot("drawer-375")
    # Widened past the drawer with it open: the page is usable again (nothing left inert).
    c.page.set_viewport_size({"width": 1280, "height": 800})
    c.wait_until("() => !document.getElementById('main').inert")
    c.page.focus("[data-testid=prompt]")
    assert c.js(FOCUSED) == "prompt"


def test_shortcuts_are_listed_under_question_mark(chat):
    c = chat()
    c.page.focus("#new-chat")
    c.page.keyboard.press("?")
    c.wait_until("() => document.querySelector('[data-testid=shortcuts]').open")
    text = c.page.text_content("[data-testid=shortcuts]")
    for words in ("New chat", "Search", "Stop the answer", "rename"):
        assert words in text, words
    c.shot("shortcuts-1280")
    c.page.keyboard.press("Escape")
    c.wait_until("() => !document.querySelector('[data-testid=shortcuts]').open")
    c.page.focus("[data-testid=prompt]")
    c.page.keyboard.press("?")  # typing a question mark in the box is just typing
    assert c.page.input_value("[data-testid=prompt]") == "?"
    assert not c.js("document.querySelector('[data-testid=shortcuts]').open")


def axe_violations(c, serious=("serious", "critical")) -> list:
    result = c.js("""async () => {
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.slice(0, 3).map(n => n.target.join(' '))}));
    }""")  # noqa: E501
    return [v for v in result if v["impact"] in serious]


@pytest.mark.parametrize("width, scheme", [(1280, "light"), (1280, "dark"), (375, "light"), (375, "dark")])
def test_axe_finds_no_serious_violations(browser, server, width, scheme):
    context = browser.new_context(viewport={"width": width, "height": 800}, color_scheme=scheme)
    context.add_init_script(path=str(AXE))  # an init script: the page's CSP allows no inline script
    context.add_init_script("localStorage.setItem('chat.settings', JSON.stringify({max_new_tokens: 8}))")
    c = Chat(browser, server.url, context=context)
    try:
        c.open()
        assert axe_violations(c) == []
        c.send("Check **this** `code`")
        c.wait_done()
        assert axe_violations(c) == []
        c.shot(f"axe-{width}-{scheme}")
        if width < 800:
            c.page.click("#sidebar-toggle")
            c.wait_until("() => document.getElementById('app').classList.contains('sidebar-open')")
        c.page.hover("[data-testid=conversation-item]")
        c.page.click("[data-testid=conversation-item] [data-action=menu]")
        assert axe_violations(c) == []
        c.shot(f"axe-menu-{width}-{scheme}")
        c.page.keyboard.press("Escape")
        c.page.click("[data-testid=open-settings]")
        assert axe_violations(c) == []
        c.page.keyboard.press("Escape")
        c.page.keyboard.press("?")
        c.wait_until("() => document.querySelector('[data-testid=shortcuts]').open")
        assert axe_violations(c) == []
        c.shot(f"axe-shortcuts-{width}-{scheme}")
        c.page.keyboard.press("Escape")
        # Select, the trash's toast and its list.
        if width < 800 and not c.js("document.getElementById('app').classList.contains('sidebar-open')"):
            c.page.click("#sidebar-toggle")
        c.page.click("[data-testid=select-mode]")
        c.page.click("[data-testid=conversation-item] .conversation-open")
        assert axe_violations(c) == []
        c.shot(f"axe-select-{width}-{scheme}")
        c.page.click("[data-testid=bulk-delete]")
        c.page.wait_for_selector("[data-testid=toast-undo]")
        assert axe_violations(c) == []
        if width < 800 and not c.js("document.getElementById('app').classList.contains('sidebar-open')"):
            c.page.click("#sidebar-toggle")
        c.page.click("[data-testid=open-trash]")
        c.page.wait_for_selector("[data-testid=library-item]")
        assert axe_violations(c) == []
        c.shot(f"axe-trash-{width}-{scheme}")
        assert not c.errors, c.errors
    finally:
        context.close()
