"""One person, several tabs, in real headless Chromium against the live gunicorn server: each tab
keeps its own view, a second tab on a conversation follows its answer live, either tab stops it,
and no tab waits for an answer it cannot see."""
from __future__ import annotations

from helpers import WS

ASSISTANT = "[...document.querySelectorAll('[data-testid=message-assistant]')].pop()"
TEXT = f"(({ASSISTANT})?.view?.text || '').length"
CURRENT = "((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)"


def grows(c, timeout: float = 30) -> None:
    """The last answer on ``c``'s page is streaming and its text grows."""
    c.wait_until(f"() => {ASSISTANT}?.dataset.state === 'streaming' && {TEXT} > 0", timeout)
    now = c.js(TEXT)
    c.wait_until(f"() => {TEXT} > {now + 10}", timeout)


def test_a_second_tab_follows_the_answer_and_either_stops_it(chat):
    a = chat(settings={"max_new_tokens": 4000})
    a.send("A long story, please")
    a.wait_until(f"() => {TEXT} > 40")
    conv = a.js(CURRENT)

    # "/" in a second tab is a new chat: it takes nothing from the first.
    b = a.tab().open()
    assert b.js(CURRENT) is None
    assert b.page.locator("[data-testid=message-user]").count() == 0
    assert b.js("document.getElementById('chat-title').textContent") == "New chat"
    grows(a)

    # The same conversation in the second tab: the answer streams in both.
    b.page.goto(f"{a.url}/c/{conv}")
    b.wait_until("() => document.querySelector('[data-testid=message-user]')")
    grows(b)
    grows(a)
    assert b.page.is_visible("[data-testid=stop]") and a.page.is_visible("[data-testid=stop]")

    # Stop in the second tab ends it in both; each shows the whole answer as stored.
    b.page.click("[data-testid=stop]")
    assert b.wait_done(timeout=20) == "cancelled"
    assert a.wait_done(timeout=20) == "cancelled"
    stored = a.page.request.get(f"{a.url}/api/conversations/{conv}").json()["messages"][-1]["content"]
    a.wait_until("(s) => " + ASSISTANT + ".view.text === s", 10, stored)
    b.wait_until("(s) => " + ASSISTANT + ".view.text === s", 10, stored)
    assert a.page.is_visible("[data-testid=send]") and not a.page.is_visible("[data-testid=stop]")

    # The first tab is not left waiting: what it sends goes at once.
    a.send("And another?")
    assert a.page.is_hidden("[data-testid=queued]")
    a.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 2")
    # ... and the second tab, open on the conversation, follows that answer too.
    b.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 2", 20)
    grows(b)
    # Both lists mark the chat as answering while it does.
    for tab in (a, b):
        tab.wait_until(f"() => document.querySelector('[data-testid=conversation-item][data-id=\"{conv}\"]')"
                       ".classList.contains('answering')")
    a.page.click("[data-testid=stop]")
    assert a.wait_done(timeout=20) == "cancelled"
    assert b.wait_done(timeout=20) == "cancelled"
    for tab in (a, b):
        tab.wait_until(f"() => !document.querySelector('[data-testid=conversation-item][data-id=\"{conv}\"]')"
                       ".classList.contains('answering')")
    a.shot("tabs-first")
    b.shot("tabs-second")


def test_a_message_sent_while_elsewhere_answering_shows_that_answer(chat):
    a = chat(settings={"max_new_tokens": 4000})
    a.send("Start something")
    a.wait_until(f"() => {TEXT} > 5")
    a.page.click("[data-testid=stop]")
    assert a.wait_done(timeout=20) == "cancelled"
    conv = a.js(CURRENT)
    # The same person's program (no tab to tell this one) answers in the conversation.
    cookie = "; ".join(f"{k['name']}={k['value']}" for k in a.context.cookies())
    program = WS(a.url.replace("http", "ws", 1) + "/ws", cookie=cookie)
    program.send({"type": "chat", "id": "prog", "conversation_id": conv, "content": "From a program",
                  "params": {"temperature": 0.8, "seed": 1, "max_new_tokens": 4000}})
    program.until(lambda f: f["type"] == "delta")
    a.send("Me too")
    # Refused as busy: the text is given back, and that answer shows here, live.
    a.wait_until("() => document.querySelectorAll('[data-testid=message-user] .msg-body')[1]?.textContent"
                 " === 'From a program'", 20)
    assert a.page.locator("[data-testid=message-user]").count() == 2
    assert "still being written" in a.page.text_content("[data-testid=error]")
    assert a.page.input_value("[data-testid=prompt]") == "Me too"
    grows(a)
    a.page.click("[data-testid=stop]")
    assert a.wait_done(timeout=20) == "cancelled"
    assert program.until(lambda f: f["type"] == "done")[-1]["reason"] == "cancelled"
    program.close()
