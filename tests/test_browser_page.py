"""The page a demanding user keeps, in real headless Chromium against the live gunicorn server:
landing on the latest message, the whole tree through export and import, editing, a message
typed during an answer, each conversation's own settings, the sidebar's dates and pins,
/c/<id> addresses, the model picker, and the small things (gaps, arrows, the dialog, Regenerate)."""
from __future__ import annotations

import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
from helpers import UPSTREAM_MODELS, Chat, Upstream

LAST_ASSISTANT = "[...document.querySelectorAll('[data-testid=message-assistant]')].pop()"
DISTANCE = ("(() => { const m = document.getElementById('messages');"
            " return m.scrollHeight - m.scrollTop - m.clientHeight; })()")
# How far the last message's bottom row (stats, actions) lies below the visible part of the thread.
HIDDEN_BELOW = """(() => { const box = document.getElementById('messages').getBoundingClientRect();
    const last = [...document.querySelectorAll('.msg')].pop();
    return Math.round(last.querySelector('.msg-meta').getBoundingClientRect().bottom - box.bottom); })()"""
WIDTHS = pytest.mark.parametrize("width, height", [(375, 740), (1280, 800)], ids=["phone", "desktop"])


def conversation_id(c) -> str:
    return c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")


def stored(c, conv=None) -> dict:
    return c.page.request.get(f"{c.url}/api/conversations/{conv or conversation_id(c)}").json()


def import_via_api(c, body) -> str:
    return c.page.request.post(f"{c.url}/api/conversations/import", data=json.dumps(body),
                               headers={"Content-Type": "application/json"}).json()["id"]


def user_texts(c) -> list[str]:
    return c.js("[...document.querySelectorAll('[data-testid=message-user] .msg-body')].map(e => e.textContent)")


def scripted_socket(c, models=("scripted",)):
    """Answer the page's WebSocket from the test: returns {'ws', 'sent'}; `ready` lists ``models``."""
    sock = {"sent": []}

    def route(ws):
        sock["ws"] = ws
        ws.on_message(lambda message: sock["sent"].append(json.loads(message)))
        ws.send(json.dumps({"type": "ready", "protocol": "chat.v1", "model": models[0], "models": list(models),
                            "limits": {"max_content_chars": 1000, "max_new_tokens": 100, "context_tokens": 1000,
                                       "max_active_per_connection": 2}}))

    c.page.route_web_socket("**/ws", route)
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    return sock


def wait_sent(c, sock, kind, count=1):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        frames = [f for f in sock["sent"] if f["type"] == kind]
        if len(frames) >= count:
            return frames[count - 1]
        c.page.wait_for_timeout(20)
    raise AssertionError(f"no {kind} frame sent: {sock['sent']}")


def heavy_conversation(turns: int = 30) -> dict:
    """An export whose answers have code and tables: their height is known only once laid out."""
    code = "```python\n" + "\n".join(f"def f{i}(x):\n    return x * {i}  # a comment" for i in range(12)) + "\n```"
    table = "| a | b | c |\n|---|---|---|\n" + "\n".join(f"| {i} | {i * i} | text {i} |" for i in range(8))
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: show me code and a table"},
                     {"role": "assistant", "content": f"Answer {i}.\n\n{code}\n\n{table}\n\nThe end of answer {i}.",
                      "reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 50},
                      "timings": {"ttft_ms": 10, "total_ms": 100, "tokens_per_s": 50}}]
    return {"title": "Heavy", "messages": messages}


# ---------------------------------------------------------------- 1. landing on the latest message

@WIDTHS
def test_opens_at_the_latest_message_and_stays_there_while_layout_settles(chat, width, height):
    c = chat(width=width, height=height)
    conv = import_via_api(c, heavy_conversation())
    c.page.goto(f"{c.url}/c/{conv}")
    c.wait_until("() => document.querySelectorAll('.msg').length === 60")
    # Measured over a second: far messages get their real height as they are laid out.
    samples = []
    for _ in range(10):
        samples.append((round(c.js(DISTANCE)), c.js(HIDDEN_BELOW)))
        c.page.wait_for_timeout(100)
    assert all(d <= 1 for d, _ in samples[3:]), samples
    assert samples[-1][1] <= 0, f"the last answer's stats are cut off: {samples}"
    # Content growing late (a block laid out again) is followed while the reader has not scrolled.
    c.js(f"() => {{ const b = document.createElement('div'); b.className = 'late';"
         f" b.textContent = 'late line '.repeat(200); {LAST_ASSISTANT}.querySelector('.msg-body').append(b); }}")
    c.wait_until(f"() => {DISTANCE} <= 1", 5)
    assert c.js(HIDDEN_BELOW) <= 0
    # Once the reader scrolls up, growth never pulls the view back down.
    c.page.mouse.move(width // 2, 200)
    c.page.mouse.wheel(0, -600)
    c.page.wait_for_timeout(300)
    top = c.js("document.getElementById('messages').scrollTop")
    c.js(f"() => {LAST_ASSISTANT}.querySelector('.msg-body').append(document.createTextNode(' more'.repeat(300)))")
    c.page.wait_for_timeout(300)
    assert c.js("document.getElementById('messages').scrollTop") == top
    assert c.page.is_visible("#jump")
    c.shot(f"opened-at-end-{width}")


@WIDTHS
def test_a_finished_answer_is_fully_visible(chat, width, height):
    c = chat(width=width, height=height, settings={"max_new_tokens": 120})
    for text in ("First question, to fill the page", "A second one, answered long enough to scroll"):
        c.send(text)
        c.wait_done()
    c.wait_until(f"() => {HIDDEN_BELOW} <= 0 && {DISTANCE} <= 1", 5)
    assert c.js("document.getElementById('messages').scrollHeight > document.getElementById('messages').clientHeight")


# ---------------------------------------------------------------- 2. the whole tree through export and import

def test_export_carries_every_version_and_import_restores_it(chat, tmp_path):
    c = chat(settings={"max_new_tokens": 6, "temperature": 0})
    c.send("Question to branch")
    c.wait_done()
    c.wait_until("() => document.querySelector('[data-testid=message-user][data-id]')")
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "Question to branch, edited")
    c.page.click("[data-testid=edit-save]")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 1")
    c.wait_done()
    c.page.click("[data-testid=regenerate]:visible")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 2")
    c.wait_done()
    original = conversation_id(c)
    # Export from the menu: the menu closes after the choice, the file has the whole tree.
    c.page.click("[data-testid=conversation-menu] summary")
    assert c.page.is_visible("[data-testid=export-json]")
    with c.page.expect_download() as download:
        c.page.click("[data-testid=export-json]")
    path = tmp_path / "export.json"
    download.value.save_as(path)
    assert not c.js("document.querySelector('[data-testid=conversation-menu]').open")
    exported = json.loads(path.read_text())
    assert len(exported["tree"]) == 5 and exported["active_id"] == exported["messages"][-1]["id"]
    # Import it: the copy opens with every version, under a title that says it is a copy.
    c.page.set_input_files("[data-testid=import-file]", files=[str(path)])
    c.wait_until(f"() => ((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null) !== '{original}'")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 2")
    labels = c.js("[...document.querySelectorAll('[data-testid=versions] .versions-label')].map(e => e.textContent)")
    assert labels == ["2/2", "2/2"]
    assert user_texts(c) == ["Question to branch, edited"]
    titles = c.js("[...document.querySelectorAll('[data-testid=conversation-item] .conversation-title')]"
                  ".map(e => e.textContent)")
    assert sorted(titles) == ["Question to branch, edited", "Question to branch, edited (imported)"]
    assert c.page.text_content("#chat-title") == "Question to branch, edited (imported)"
    c.page.click("[data-testid=versions] [data-action=version-prev]")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '1/2'")
    assert user_texts(c) == ["Question to branch"]
    # Older single-path exports and OpenAI-style lists still come in.
    old = {k: v for k, v in exported.items() if k not in ("tree", "active_id")}
    c.page.set_input_files("[data-testid=import-file]", files=[
        {"name": "old.json", "mimeType": "application/json", "buffer": json.dumps(old).encode()},
        {"name": "openai.json", "mimeType": "application/json", "buffer": json.dumps({"messages": [
            {"role": "system", "content": "Be kind."}, {"role": "user", "content": "OpenAI style"},
            {"role": "assistant", "content": "Hello!"}]}).encode()}])
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 4")
    c.wait_until("() => document.querySelector('#chat-title').textContent === 'OpenAI style (imported)'"
                 " && document.querySelectorAll('[data-testid=message-user]').length > 0")
    assert user_texts(c) == ["OpenAI style"] and c.answer() == "Hello!"
    assert c.page.text_content("#chat-title") == "OpenAI style (imported)"


# ---------------------------------------------------------------- 3. the font stack names CJK fonts

def test_the_font_stack_names_cjk_fonts(chat):
    c = chat(settings={"max_new_tokens": 4})
    c.send("你好，请用中文介绍一下你自己。日本語も、한국어도。")
    c.wait_done()
    for selector in ("body", "[data-testid=message-user] .msg-body", "[data-testid=prompt]", "[data-testid=search]"):
        family = c.js(f"getComputedStyle(document.querySelector({json.dumps(selector)})).fontFamily")
        for name in ("Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", "Hiragino Sans", "Malgun Gothic"):
            assert name in family, (selector, family)


# ---------------------------------------------------------------- 4. editing

@WIDTHS
def test_edit_has_save_and_cancel_and_the_title_follows_the_first_message(chat, width, height):
    c = chat(width=width, height=height, settings={"max_new_tokens": 4})
    c.send("Original first question")
    c.wait_done()
    c.wait_until("() => document.querySelector('[data-testid=message-user][data-id]')")
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=edit]")
    assert c.page.is_visible("[data-testid=edit-save]") and c.page.is_visible("[data-testid=edit-cancel]")
    c.shot(f"edit-{width}")
    c.page.fill("[data-testid=edit-box]", "never sent")
    c.page.click("[data-testid=edit-cancel]")
    assert user_texts(c) == ["Original first question"] and c.page.locator("[data-testid=edit-box]").count() == 0
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "   ")
    assert c.page.is_disabled("[data-testid=edit-save]")
    c.page.fill("[data-testid=edit-box]", "Edited first question")
    c.page.click("[data-testid=edit-save]")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 1")
    c.wait_done()
    c.wait_until("() => document.getElementById('chat-title').textContent === 'Edited first question'")
    c.wait_until("() => document.querySelector('[data-testid=conversation-item] .conversation-title')"
                 "?.textContent === 'Edited first question'")
    assert stored(c)["title"] == "Edited first question"
    # Renamed by the user: an edit no longer changes the title.
    conv = conversation_id(c)
    c.page.request.patch(f"{c.url}/api/conversations/{conv}", data=json.dumps({"title": "My name for it"}),
                         headers={"Content-Type": "application/json"})
    c.page.reload()
    c.page.wait_for_selector("[data-testid=message-user][data-id]")
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "Edited once more")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '3/3'")
    c.wait_done()
    assert stored(c)["title"] == "My name for it"
    assert c.page.text_content("#chat-title") == "My name for it"


@WIDTHS
def test_a_message_typed_while_an_answer_streams_is_sent_when_it_ends(chat, width, height):
    c = chat(width=width, height=height, settings={"max_new_tokens": 4000})
    c.send("A long answer, please")
    c.wait_until(f"() => {LAST_ASSISTANT}?.dataset.state === 'streaming'")
    c.page.fill("[data-testid=prompt]", "Asked while it was writing")
    assert c.page.is_visible("[data-testid=send]") and c.page.is_visible("[data-testid=stop]")
    assert "finishes" in c.page.get_attribute("[data-testid=send]", "title")
    c.page.keyboard.press("Enter")
    assert c.page.is_visible("[data-testid=queued]")
    assert "Queued" in c.page.get_attribute("[data-testid=send]", "title")
    assert c.page.input_value("[data-testid=prompt]") == "Asked while it was writing"
    assert c.page.locator("[data-testid=message-user]").count() == 1
    c.shot(f"queued-{width}")
    c.page.click("[data-testid=stop]")
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user]').length === 2", 15)
    assert user_texts(c) == ["A long answer, please", "Asked while it was writing"]
    assert c.page.input_value("[data-testid=prompt]") == "" and c.page.is_hidden("[data-testid=queued]")
    # "Don't send" keeps the text in the box and sends nothing when the answer ends.
    c.wait_until(f"() => {LAST_ASSISTANT}?.dataset.state === 'streaming'")
    c.page.fill("[data-testid=prompt]", "Kept, not sent")
    c.page.keyboard.press("Enter")
    c.page.click("[data-testid=queued-cancel]")
    c.page.click("[data-testid=stop]")
    assert c.wait_done(15) == "cancelled"
    c.page.wait_for_timeout(300)
    assert c.page.locator("[data-testid=message-user]").count() == 2
    assert c.page.input_value("[data-testid=prompt]") == "Kept, not sent"


# ---------------------------------------------------------------- 5. a conversation's own settings

def test_a_conversation_keeps_and_shows_its_own_settings(chat):
    c = chat(settings={"system": "You are terse.", "temperature": 0.4, "max_new_tokens": 6, "seed": 11})
    frames = []
    c.page.on("websocket", lambda ws: ws.on("framesent", lambda payload: frames.append(json.loads(payload))))
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Hello there")
    c.wait_done()
    conv = conversation_id(c)
    record = stored(c, conv)
    assert (record["system"], record["params"]) == ("You are terse.",
                                                    {"temperature": 0.4, "max_new_tokens": 6, "seed": 11})
    c.wait_until("() => !document.querySelector('[data-testid=chat-info]').hidden")
    info = c.page.text_content("[data-testid=chat-info]")
    assert "You are terse." in info and "seed 11" in info and "temperature 0.4" in info
    # Changing the defaults later does not change this conversation.
    c.page.click("[data-testid=open-settings]")
    assert c.page.text_content("[data-testid=settings-title]") == "Settings"
    c.page.fill("#set-seed", "99")
    c.page.click("[data-testid=settings-done]")
    # Its own settings, from the conversation menu: the dialog shows them, changes are stored for it.
    c.page.click("[data-testid=conversation-menu] summary")
    c.page.click("[data-testid=open-chat-settings]")
    assert not c.js("document.querySelector('[data-testid=conversation-menu]').open")
    assert c.page.text_content("[data-testid=settings-title]") == "Chat settings"
    assert c.page.input_value("#set-system") == "You are terse." and c.page.input_value("#set-seed") == "11"
    c.page.fill("#set-system", "You are verbose.")
    c.page.fill("#set-max-tokens", "5")
    c.wait_until("() => document.querySelector('[data-testid=settings-status]').textContent.includes('Saved')", 5)
    c.page.click("[data-testid=settings-done]")
    record = stored(c, conv)
    assert (record["system"], record["params"]) == ("You are verbose.",
                                                    {"temperature": 0.4, "max_new_tokens": 5, "seed": 11})
    assert "You are verbose." in c.page.text_content("[data-testid=chat-info]")
    c.send("And again")
    c.wait_done()
    follow_up = [f for f in frames if f["type"] == "chat"][-1]
    assert "params" not in follow_up and "system" not in follow_up, "the server keeps this conversation's settings"
    stats = c.page.text_content("[data-testid=message-assistant] >> nth=-1 >> [data-testid=stats]")
    assert stats.split(" · ").count("5 tokens") == 1
    # Regenerate with the seed: each new version is the same.
    versions = []
    for _ in range(2):
        c.js(f"() => {{ window.__old = {LAST_ASSISTANT}; }}")
        c.page.click("[data-testid=regenerate]:visible")
        c.wait_until(f"() => {LAST_ASSISTANT} !== window.__old && {LAST_ASSISTANT}.dataset.state === 'done'")
        versions.append(c.answer())
    assert versions[0] == versions[1] and versions[0]
    assert "Regenerate writes the same new version" in c.page.text_content("[data-testid=seed-help]")
    # A new chat takes the defaults as they are now.
    c.page.click("[data-testid=new-chat]")
    c.send("Fresh one")
    c.wait_done()
    assert stored(c)["params"]["seed"] == 99


def test_sidebar_groups_by_date_pins_and_keeps_order_on_rename(chat):
    c = chat(settings={"max_new_tokens": 2})
    for text in ("Oldest topic", "Middle topic", "Newest topic"):
        c.page.click("[data-testid=new-chat]")
        c.send(text)
        c.wait_done()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 3")
    order = ("[...document.querySelectorAll('[data-testid=conversation-item] .conversation-title')]"
             ".map(e => e.textContent)")
    assert c.js(order) == ["Newest topic", "Middle topic", "Oldest topic"]
    groups = "[...document.querySelectorAll('[data-testid=conversation-group] .group-title')].map(e => e.textContent)"
    assert c.js(groups) == ["Today"]
    oldest = "[data-testid=conversation-item] >> nth=2"
    c.page.hover(oldest)
    c.page.click(f"{oldest} >> [data-action=menu]")
    c.page.click("[data-testid=menu-rename]")
    c.page.fill("[data-testid=conversation-item] input", "Oldest, renamed")
    c.page.keyboard.press("Enter")
    c.page.reload()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 3")
    assert c.js(order) == ["Newest topic", "Middle topic", "Oldest, renamed"], "renaming moved it"
    c.page.hover(oldest)
    c.page.click(f"{oldest} >> [data-action=menu]")
    c.page.click("[data-testid=menu-pin]")
    c.wait_until(f"() => {order}[0] === 'Oldest, renamed'")
    c.page.reload()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 3")
    assert c.js(order) == ["Oldest, renamed", "Newest topic", "Middle topic"]
    assert c.js(groups) == ["Pinned", "Today"]
    assert c.page.get_attribute("[data-testid=conversation-item] >> nth=0", "data-pinned") == "true"
    c.page.hover("[data-testid=conversation-item] >> nth=0")
    c.page.click("[data-testid=conversation-item] >> nth=0 >> [data-action=menu]")
    assert c.page.text_content("[data-testid=menu-pin]") == "Unpin"
    c.page.keyboard.press("Escape")
    c.shot("sidebar-pinned")


@WIDTHS
def test_date_groups(chat, width, height):
    """Yesterday, the week and older: the list as the server gives it, dated by the page's own clock."""
    c = chat(width=width, height=height)
    now = time.time()
    day = 86400
    listed = [{"id": f"{i:032x}", "title": title, "system": None, "created_at": now - age, "updated_at": now - age,
               "pinned": pinned, "params": {}, "model": None}
              for i, (title, age, pinned) in enumerate([
                  ("Pinned long ago", 90 * day, True), ("Just now", 1, False), ("Yesterday's", day, False),
                  ("Three days ago", 3 * day, False), ("Last month", 30 * day, False)])]
    c.page.route("**/api/conversations", lambda route: route.fulfill(json=listed))
    c.page.reload()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 5")
    groups = c.js("""[...document.querySelectorAll('[data-testid=conversation-group]')].map(g =>
        [g.querySelector('.group-title').textContent,
         [...g.querySelectorAll('.conversation-title')].map(t => t.textContent)])""")
    assert groups == [["Pinned", ["Pinned long ago"]], ["Today", ["Just now"]], ["Yesterday", ["Yesterday's"]],
                      ["Previous 7 days", ["Three days ago"]], ["Older", ["Last month"]]]
    if width < 800:
        c.page.click("#sidebar-toggle")
        c.page.wait_for_selector("#sidebar [data-testid=conversation-item]", state="visible")
        c.page.wait_for_timeout(400)  # the drawer's slide
    c.shot(f"sidebar-groups-{width}")


# ---------------------------------------------------------------- 6. /c/<id> addresses

def test_addresses_open_switch_and_go_back(chat):
    c = chat(settings={"max_new_tokens": 2})
    c.send("First conversation")
    c.wait_done()
    first = conversation_id(c)
    assert c.page.url == f"{c.url}/c/{first}"
    c.page.click("[data-testid=new-chat]")
    assert c.page.url == f"{c.url}/"
    c.send("Second conversation")
    c.wait_done()
    second = conversation_id(c)
    c.wait_until(f"() => location.pathname === '/c/{second}'")
    c.page.click(f"[data-testid=conversation-item][data-id='{first}'] .conversation-open")
    c.wait_until(f"() => location.pathname === '/c/{first}' && "
                 "document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                 " === 'First conversation'")
    c.page.go_back()
    c.wait_until(f"() => location.pathname === '/c/{second}' && "
                 "document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                 " === 'Second conversation'")
    c.page.go_back()  # the new chat the second conversation started from became its address
    c.wait_until(f"() => location.pathname === '/c/{first}' && "
                 "document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                 " === 'First conversation'")
    c.page.go_forward()
    c.wait_until(f"() => location.pathname === '/c/{second}' && "
                 "document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                 " === 'Second conversation'")
    # A bookmark: a fresh page at the address opens that conversation, whatever was open last.
    page = c.context.new_page()
    page.goto(f"{c.url}/c/{first}")
    page.wait_for_function("() => document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                           " === 'First conversation'")
    assert page.text_content("#chat-title") == "First conversation"
    page.reload()
    page.wait_for_function("() => document.querySelector('[data-testid=message-user] .msg-body')?.textContent"
                           " === 'First conversation'")
    page.close()


@pytest.mark.parametrize("address", ["/c/" + "0" * 32, "/c/not-an-id", "/c/%E2%9C%93"])
def test_an_address_the_user_cannot_see_shows_a_new_chat_that_says_so(chat, browser, address):
    owner = chat(settings={"max_new_tokens": 2})
    owner.send("Private conversation")
    owner.wait_done()
    theirs = conversation_id(owner)
    c = chat()
    said = set()
    for path in (address, f"/c/{theirs}"):
        c.page.goto(c.url + path)
        c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
        c.wait_until("() => location.pathname === '/'")
        assert c.page.is_visible("#empty") and c.page.locator(".msg").count() == 0
        # The same words whether it never existed or is someone else's.
        c.wait_until("() => !document.querySelector('[data-testid=error]').hidden")
        said.add(c.page.text_content("[data-testid=error]"))
        assert c.page.text_content("#chat-title") == "New chat"
    assert len(said) == 1 and "not found" in said.pop()
    assert "Private" not in c.page.content()


# ---------------------------------------------------------------- 7. the model picker

@pytest.fixture(scope="module")
def multi_model(server_factory):
    """This server's web tier (gunicorn) in front of an upstream serving several models."""
    handler = type("Handler", (Upstream,), {"models": list(UPSTREAM_MODELS), "asked": []})
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    srv = server_factory("multimodel", CHAT_BACKEND="openai",
                         CHAT_BACKEND_URL=f"http://127.0.0.1:{upstream.server_port}/v1",
                         CHAT_BACKEND_MODELS="qwen*,llama*")
    yield srv, handler
    upstream.shutdown()
    upstream.server_close()


@WIDTHS
def test_the_model_picker_picks_per_conversation(browser, multi_model, width, height):
    srv, handler = multi_model
    c = Chat(browser, srv.url, width=width, height=height).open()
    try:
        picker = "[data-testid=model-picker]"
        assert c.page.is_visible(picker)
        assert c.js(f"[...document.querySelector('{picker}').options].map(o => o.value)") == [
            "qwen2.5:0.5b", "llama3.2:1b", "qwen2.5:7b"]
        c.page.select_option(picker, "llama3.2:1b")
        c.send("Who are you?")
        assert c.wait_done() == "stop"
        assert c.answer() == "I am llama3.2:1b."
        first = conversation_id(c)
        assert stored(c, first)["model"] == "llama3.2:1b"
        c.shot(f"model-picker-{width}")
        # Another model for this conversation, from the picker: stored, and the next answer uses it.
        c.page.select_option(picker, "qwen2.5:7b")
        deadline = time.monotonic() + 5
        while stored(c, first)["model"] != "qwen2.5:7b" and time.monotonic() < deadline:
            time.sleep(0.05)
        c.send("And now?")
        c.wait_until(f"() => {LAST_ASSISTANT}?.view.text === 'I am qwen2.5:7b.'")
        # A new chat starts with the model picked last for a new chat; the old one keeps its own.
        if width < 800:
            c.page.click("#sidebar-toggle")
        c.page.click("[data-testid=new-chat]")
        assert c.page.input_value(picker) == "llama3.2:1b"
        c.send("Hello")
        c.wait_until(f"() => {LAST_ASSISTANT}?.view.text === 'I am llama3.2:1b.'")
        c.page.goto(f"{srv.url}/c/{first}")
        c.wait_until(f"() => document.querySelector('{picker}').value === 'qwen2.5:7b'")
        assert c.errors == []
    finally:
        c.close()


def test_the_picker_hides_with_one_model(chat):
    c = chat()
    assert c.page.is_hidden("[data-testid=model-picker]")
    assert c.page.text_content("[data-testid=model-name]").strip()


# ---------------------------------------------------------------- 8. the smaller points

@WIDTHS
def test_question_answer_gap_and_version_arrows(chat, width, height):
    c = chat(width=width, height=height, settings={"max_new_tokens": 6, "temperature": 0})
    c.send("One")
    c.wait_done()
    c.send("Two")
    c.wait_done()
    c.page.click("[data-testid=regenerate]:visible")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 1")
    c.wait_done()
    c.page.mouse.move(0, 0)
    gaps = c.js("""() => {
        const rect = (el) => el.getBoundingClientRect();
        const users = [...document.querySelectorAll('[data-testid=message-user] .msg-body')];
        const answers = [...document.querySelectorAll('[data-testid=message-assistant]')];
        return { qa: rect(answers[0]).top - rect(users[0]).bottom,
                 turn: rect(users[1]).top - rect(answers[0].querySelector('.msg-meta')).bottom }; }""")
    assert gaps["qa"] <= gaps["turn"] + 4, gaps
    box = c.page.locator("[data-testid=versions] [data-action=version-prev]").bounding_box()
    assert box["width"] >= 32 and box["height"] >= 32
    contrast = c.js("""() => {
        const lum = (rgb) => { const [r, g, b] = rgb.match(/\\d+/g).slice(0, 3).map((v) => { v /= 255;
            return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
          return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
        const fg = lum(getComputedStyle(document.querySelector('[data-testid=versions] .versions-label')).color);
        const bg = lum(getComputedStyle(document.body).backgroundColor);
        return (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05); }""")
    assert contrast >= 4.5, contrast
    c.shot(f"gaps-{width}")


@pytest.mark.parametrize("width, height", [(1280, 800), (375, 640)], ids=["desktop", "phone"])
def test_the_settings_dialog_fits_the_window(chat, width, height):
    c = chat(width=width, height=height)
    if width < 800:
        c.page.click("#sidebar-toggle")
    c.page.click("[data-testid=open-settings]")
    done = c.page.locator("[data-testid=settings-done]").bounding_box()
    dialog = c.page.locator("#settings").bounding_box()
    assert dialog["y"] >= 12 and dialog["y"] + dialog["height"] <= height - 12, dialog
    assert done["y"] + done["height"] <= height - 24, done
    # every field can be reached, the buttons staying in place
    c.page.focus("#set-seed")
    assert c.page.locator("#set-seed").is_visible()
    assert c.page.locator("[data-testid=settings-done]").bounding_box() == done
    c.shot(f"settings-{width}")


def test_regenerate_keeps_the_old_answer_until_the_new_one_writes(chat):
    c = chat()
    sock = scripted_socket(c)
    conv, mid = "a" * 32, "b" * 32
    c.page.route(f"**/api/conversations/{conv}", lambda route: route.fulfill(json={
        "id": conv, "title": "Question", "system": None, "params": {}, "model": None, "pinned": False,
        "created_at": 1, "updated_at": 1, "messages": [
            {"id": "c" * 32, "parent_id": None, "role": "user", "content": "Question", "attachments": [],
             "status": "complete", "reason": None, "versions": {"index": 0, "count": 1, "ids": ["c" * 32]}},
            {"id": mid, "parent_id": "c" * 32, "role": "assistant", "content": "The first answer.", "attachments": [],
             "status": "complete", "reason": "stop", "versions": {"index": 0, "count": 1, "ids": [mid]}}]}))
    c.send("Question")
    frame = wait_sent(c, sock, "chat")
    ws = sock["ws"]
    ws.send(json.dumps({"type": "start", "id": frame["id"], "conversation_id": conv, "message_id": mid}))
    ws.send(json.dumps({"type": "delta", "id": frame["id"], "index": 0, "text": "The first answer."}))
    ws.send(json.dumps({"type": "done", "id": frame["id"], "reason": "stop",
                        "usage": {"prompt_tokens": 1, "completion_tokens": 3},
                        "timings": {"ttft_ms": 1, "total_ms": 2, "tokens_per_s": 3}}))
    c.wait_done()
    c.wait_until(f"() => {LAST_ASSISTANT}.dataset.id === '{mid}'")
    c.page.click("[data-testid=regenerate]:visible")
    regen = wait_sent(c, sock, "regenerate")
    ws.send(json.dumps({"type": "start", "id": regen["id"], "conversation_id": conv, "message_id": "d" * 32}))
    c.page.wait_for_timeout(200)
    # Before the new version writes anything: the old answer is still there, and the counter shows.
    assert c.page.locator("[data-testid=message-assistant]").count() == 1
    assert "The first answer." in c.page.text_content("[data-testid=message-assistant] .msg-body")
    assert "version 2 of 2" in c.page.text_content("[data-testid=regenerating]")
    c.shot("regenerating-waiting")
    ws.send(json.dumps({"type": "delta", "id": regen["id"], "index": 0, "text": "A new answer"}))
    c.wait_until(f"() => {LAST_ASSISTANT}.view.text === 'A new answer'")
    assert c.page.locator("[data-testid=message-assistant]").count() == 1
    assert c.page.text_content("[data-testid=versions] .versions-label") == "2/2"
    assert c.js("[...document.querySelectorAll('[data-testid=versions] button')].every(b => b.disabled)")
    c.shot("regenerating")
