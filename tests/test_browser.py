"""The chat page in real headless Chromium, against the live gunicorn server with the tiny model.

The fixtures ``browser`` and ``chat`` are in conftest.py, the ``Chat`` page driver in helpers.py."""
from __future__ import annotations

import json
import time

XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script><b id="injected">bold?</b>'

MARKDOWN = """# Title

Some **bold**, *italic* and `inline code`.

- one
- two

| a | b |
|---|---|
| 1 | 2 |

```python
def add(a, b):
    return a + b
```

<script>window.__xss = 3</script><img src=x onerror="window.__xss=4">

[bad link](javascript:window.__xss=5) and [good link](https://example.org/)
"""


def test_answer_streams_and_grows(chat):
    c = chat(settings={"max_new_tokens": 60})
    c.js("""() => { window.__lengths = []; window.__thinking = false;
        new MutationObserver(() => {
          const m = [...document.querySelectorAll('[data-testid=message-assistant]')].pop();
          if (m && m.dataset.state === 'waiting' && m.querySelector('[data-testid=thinking]')) window.__thinking = true;
          if (m && m.dataset.state !== 'done' && !document.querySelector('[data-testid=stop]').hidden)
            window.__stopShown = true;
          if (m && m.dataset.state !== 'done') window.__lengths.push(m.view.text.length);
        }).observe(document.getElementById('thread'), {subtree: true, childList: true, characterData: true}); }""")
    c.send("Tell me a story")
    c.page.wait_for_selector("[data-testid=message-user]")
    assert c.wait_done() == "length"
    assert c.js("window.__stopShown"), "Send did not turn into Stop while streaming"
    lengths = c.js("window.__lengths")
    growth = sorted({n for n in lengths if n > 0})
    assert len(growth) >= 3, f"answer did not grow over several frames: {lengths}"
    assert lengths == sorted(lengths), "the streamed text shrank"
    assert c.js("window.__thinking"), "no thinking indicator before the first delta"
    assert c.answer().strip()
    assert c.page.is_visible("[data-testid=send]") and not c.page.is_visible("[data-testid=stop]")
    stats = c.page.text_content("[data-testid=stats]")
    assert "first token" in stats and "tokens/s" in stats and "60 tokens" in stats
    assert c.page.text_content("[data-testid=model-name]").strip()
    assert c.page.locator("[data-testid=conversation-item]").count() == 1
    c.shot("answer-streamed")


def test_auto_scroll_follows_and_yields_to_the_reader(chat):
    # A scripted socket paces the stream, so this checks the page, not the model's speed.
    c = chat(width=700, height=480)
    sock = {"sent": []}

    def route(ws):
        sock["ws"] = ws
        ws.on_message(lambda message: sock["sent"].append(json.loads(message)))
        ws.send(json.dumps({"type": "ready", "protocol": "chat.v1", "model": "scripted", "limits": {
            "max_content_chars": 1000, "max_new_tokens": 100, "context_tokens": 1000,
            "max_active_per_connection": 1}}))

    c.page.route_web_socket("**/ws", route)
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Write a long answer")
    deadline = time.monotonic() + 10
    while not sock["sent"] and time.monotonic() < deadline:
        c.page.wait_for_timeout(20)
    rid = sock["sent"][-1]["id"]
    sock["ws"].send(json.dumps({"type": "start", "id": rid, "conversation_id": "0" * 32, "message_id": "1" * 32}))
    index = 0

    def stream(n):
        nonlocal index
        for _ in range(n):
            sock["ws"].send(json.dumps({"type": "delta", "id": rid, "index": index,
                                        "text": f"Paragraph {index} of a long answer.\n\n"}))
            index += 1
            c.page.wait_for_timeout(15)
        c.page.wait_for_timeout(150)

    distance = ("(() => { const m = document.getElementById('messages');"
                " return m.scrollHeight - m.scrollTop - m.clientHeight; })()")
    stream(40)
    assert c.js("document.getElementById('messages').scrollHeight"
                " > 2 * document.getElementById('messages').clientHeight")
    assert c.js(distance) < 40, "the view did not follow the stream"
    c.page.mouse.move(350, 200)
    c.page.mouse.wheel(0, -250)
    c.page.wait_for_timeout(300)
    top = c.js("document.getElementById('messages').scrollTop")
    stream(20)
    assert c.js("document.getElementById('messages').scrollTop") == top, "auto-scroll fought the reader"
    assert c.js(distance) > 150
    assert c.page.is_visible("#jump")
    c.page.click("#jump")
    c.page.wait_for_timeout(800)
    stream(20)
    assert c.js(distance) < 40, "following did not resume"
    sock["ws"].send(json.dumps({"type": "done", "id": rid, "reason": "stop",
                                "usage": {"prompt_tokens": 5, "completion_tokens": index},
                                "timings": {"ttft_ms": 12.5, "total_ms": 900, "tokens_per_s": 88.8}}))
    assert c.wait_done(timeout=10) == "stop"
    stats = c.page.text_content("[data-testid=stats]")
    assert stats.startswith("13 ms to first token · 88.8 tokens/s · 80 tokens · ") and stats.endswith("% of the context")  # noqa: E501
    assert c.answer().count("Paragraph") == 80


def test_stop_ends_the_stream(chat):
    c = chat(settings={"max_new_tokens": 4000})
    c.send("Go on for a long time")
    c.wait_until("() => document.querySelector('[data-testid=message-assistant]')?.dataset.state === 'streaming'")
    c.page.click("[data-testid=stop]")
    assert c.wait_done(timeout=10) == "cancelled"
    assert "Stopped" in c.page.text_content("[data-testid=done-reason]")
    final = c.answer()
    assert c.page.is_visible("[data-testid=send]")
    c.shot("stopped")

    c.send("And again, stop with Esc")
    c.wait_until("() => [...document.querySelectorAll('[data-testid=message-assistant]')].pop()?.dataset.state"
                 " === 'streaming'")
    # The second answer's frames follow anything still sent for the first on the same socket.
    first = "() => document.querySelector('[data-testid=message-assistant]').view.text"
    assert c.js(first) == final, "text kept arriving after Stop"
    c.page.keyboard.press("Escape")
    assert c.wait_done(timeout=10) == "cancelled"


def test_markdown_rendering_highlighting_and_sanitizing(chat):
    c = chat()
    result = c.js("""async (src) => {
        const base = document.querySelector('script[type=module]').src;
        const md = await import(new URL('markdown.js', base).href);
        const div = document.createElement('div');
        div.innerHTML = md.renderMarkdownToHtml(src);
        const q = (s) => div.querySelectorAll(s).length;
        return {
          h1: q('h1'), strong: q('strong'), em: q('em'), li: q('li'), table: q('table'), inline: q(':not(pre) > code'),
          pythonCode: q('pre code.hljs.language-python'),
          keyword: div.querySelector('pre code .hljs-keyword')?.textContent,
          copy: q('.code-block button.copy-btn'),
          codeText: div.querySelector('pre code').textContent,
          scripts: q('script'), imgs: q('img'), handlers: q('[onerror]'),
          hrefs: [...div.querySelectorAll('a')].map((a) => a.getAttribute('href')),
          targets: [...div.querySelectorAll('a[href]')].map((a) => a.rel),
          text: div.textContent,
        };
    }""", MARKDOWN)
    assert result["h1"] == 1 and result["strong"] == 1 and result["em"] == 1
    assert result["li"] == 2 and result["table"] == 1 and result["inline"] == 1
    assert result["pythonCode"] == 1 and result["keyword"] == "def"
    assert result["copy"] == 1
    assert result["codeText"] == "def add(a, b):\n    return a + b"
    assert result["scripts"] == 0 and result["imgs"] == 0 and result["handlers"] == 0
    assert "<script>" in result["text"], "raw HTML from the model is shown as text"
    assert not any(h and h.startswith("javascript:") for h in result["hrefs"])
    assert "https://example.org/" in result["hrefs"]
    assert all("noopener" in rel for rel in result["targets"])
    assert c.js("window.__xss") is None

    # Streaming: finished blocks keep their DOM nodes while the last one grows.
    kept = c.js("""async (src) => {
        const base = document.querySelector('script[type=module]').src;
        const md = await import(new URL('markdown.js', base).href);
        const div = document.createElement('div');
        const view = new md.MarkdownView(div);
        view.update(src.slice(0, 40));
        const first = div.firstElementChild;
        for (let n = 41; n <= src.length; n += 7) view.update(src.slice(0, n));
        view.update(src, true);
        return { same: div.firstElementChild === first, blocks: div.children.length,
                 code: div.querySelectorAll('pre code .hljs-keyword').length };
    }""", MARKDOWN)
    assert kept["same"], "the first block was rebuilt while later text streamed"
    assert kept["blocks"] >= 6 and kept["code"] >= 1

    # And on the page: an answer's code block gets highlighted and a copy button.
    c.js("""async (src) => {
        const base = document.querySelector('script[type=module]').src;
        const md = await import(new URL('markdown.js', base).href);
        const article = document.createElement('article');
        article.className = 'msg msg-assistant';
        article.innerHTML = '<div class="msg-avatar"></div>'
          + '<div class="msg-main"><div class="msg-body markdown"></div></div>';
        article.querySelector('.msg-body').append(md.renderMarkdown(src));
        document.getElementById('empty').hidden = true;
        document.getElementById('thread').append(article);
    }""", MARKDOWN)
    c.shot("markdown")
    c.context.grant_permissions(["clipboard-read", "clipboard-write"])
    c.page.click(".code-block .copy-btn")
    c.wait_until("() => document.querySelector('.code-block .copy-btn').textContent.includes('Copied')", 5)
    assert c.js("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b"


def test_html_payload_in_user_message_stays_inert(chat):
    c = chat(settings={"max_new_tokens": 8})
    c.send(XSS)
    c.wait_done()
    user = c.page.locator("[data-testid=message-user] .msg-body")
    assert user.count() == 1
    assert user.text_content() == XSS
    assert c.js("document.querySelectorAll('#thread img, #thread script, #injected, [onerror]').length") == 0
    assert c.js("window.__xss") is None
    assert c.dialogs == []
    # The sidebar title (first message) is text too.
    assert c.js("document.querySelectorAll('#conversation-list img, #conversation-list b').length") == 0
    c.page.reload()
    c.page.wait_for_selector("[data-testid=message-user]")
    assert c.page.locator("[data-testid=message-user] .msg-body").text_content() == XSS
    assert c.js("document.querySelectorAll('#thread img, #thread script, #injected').length") == 0
    assert c.js("window.__xss") is None and c.dialogs == []


def test_enter_during_ime_composition_does_not_send(chat):
    c = chat(settings={"max_new_tokens": 8})
    c.page.fill("[data-testid=prompt]", "にほんご")
    c.page.focus("[data-testid=prompt]")
    c.js("""() => {
        const box = document.querySelector('[data-testid=prompt]');
        box.dispatchEvent(new CompositionEvent('compositionstart', {bubbles: true, data: ''}));
        box.dispatchEvent(new KeyboardEvent('keydown',
          {key: 'Enter', code: 'Enter', bubbles: true, cancelable: true, isComposing: true}));
        // Some browsers report the confirming Enter as keyCode 229 without isComposing.
        box.dispatchEvent(new KeyboardEvent('keydown',
          {key: 'Enter', code: 'Enter', bubbles: true, cancelable: true, keyCode: 229}));
        // Still composing (no compositionend yet): a plain Enter must not send either.
        box.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', code: 'Enter', bubbles: true, cancelable: true}));
    }""")
    # Handlers run inside dispatchEvent; a frame later anything they started has shown.
    c.js("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
    assert c.page.locator("[data-testid=message-user]").count() == 0
    assert c.page.input_value("[data-testid=prompt]") == "にほんご"
    c.js("""() => document.querySelector('[data-testid=prompt]')
        .dispatchEvent(new CompositionEvent('compositionend', {bubbles: true, data: 'にほんご'}))""")
    c.page.keyboard.press("Shift+Enter")
    assert c.page.locator("[data-testid=message-user]").count() == 0
    c.page.keyboard.press("Enter")
    c.page.wait_for_selector("[data-testid=message-user]")
    assert c.page.locator("[data-testid=message-user] .msg-body").text_content() == "にほんご"
    c.wait_done()


def test_narrow_screen_has_no_horizontal_scroll(chat):
    c = chat(width=375, height=740, settings={"max_new_tokens": 40})
    no_hscroll = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    assert c.js(no_hscroll)
    c.send("averyveryverylongwordwithoutanyspaces" * 8 + "\n```\n" + "x = 1; " * 40 + "\n```")
    c.wait_done()
    assert c.js(no_hscroll)
    assert c.page.is_visible("#sidebar-toggle") and not c.page.is_visible("#sidebar")
    c.shot("mobile-375")
    c.page.click("#sidebar-toggle")
    c.page.wait_for_selector("#sidebar [data-testid=conversation-item]", state="visible")
    assert c.js(no_hscroll)
    c.shot("mobile-375-sidebar")
    c.page.keyboard.press("Escape")
    c.wait_until("() => !document.getElementById('app').classList.contains('sidebar-open')")


def test_reload_restores_the_conversation(chat):
    c = chat(settings={"max_new_tokens": 24})
    c.send("Remember me")
    c.wait_done()
    before = c.answer()
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    assert conv
    c.page.reload()
    c.page.wait_for_selector("[data-testid=conversation-item]")
    c.page.wait_for_selector("[data-testid=message-assistant]")
    assert c.page.locator("[data-testid=message-user] .msg-body").text_content() == "Remember me"
    assert c.answer() == before
    assert c.page.text_content("#chat-title") == "Remember me"
    c.shot("reloaded")

    # A second conversation, then switching back through the sidebar.
    c.page.click("[data-testid=new-chat]")
    assert c.page.locator("[data-testid=message-user]").count() == 0
    c.send("Second topic")
    c.wait_done()
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 2")
    c.page.click(f"[data-testid=conversation-item][data-id='{conv}'] .conversation-open")
    c.wait_until("() => document.querySelector('[data-testid=message-user] .msg-body')?.textContent === 'Remember me'")
    assert c.answer() == before


def test_reload_during_an_answer_picks_the_stream_up(chat):
    c = chat(settings={"max_new_tokens": 4000})
    c.send("A long one, please")
    c.wait_until("() => (document.querySelector('[data-testid=message-assistant]')?.view?.text || '').length > 40")
    c.page.reload()
    c.page.wait_for_selector("[data-testid=message-user]")
    c.wait_until("() => document.querySelector('[data-testid=message-assistant]')?.dataset.state === 'streaming'", 10)
    first = len(c.answer())
    c.wait_until(f"() => document.querySelector('[data-testid=message-assistant]').view.text.length > {first + 20}")
    assert c.page.locator("[data-testid=message-assistant]").count() == 1
    c.page.click("[data-testid=stop]")
    assert c.wait_done(timeout=10) == "cancelled"
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    stored = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()
    assert stored["messages"][-1]["content"] == c.answer()


def test_regenerate_replaces_the_last_answer(chat):
    c = chat(settings={"max_new_tokens": 16})
    c.send("Say something")
    c.wait_done()
    c.js("() => { window.__old = document.querySelector('[data-testid=message-assistant]'); }")
    c.page.click("[data-testid=regenerate]")
    c.wait_until("""() => { const m = document.querySelector('[data-testid=message-assistant]');
                            return m !== window.__old && m.dataset.state === 'done'; }""")
    assert c.page.locator("[data-testid=message-assistant]").count() == 1
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    stored = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()
    roles = [m["role"] for m in stored["messages"]]
    assert roles == ["user", "assistant"]
    assert stored["messages"][1]["content"] == c.answer()


def test_dropped_connection_resumes_without_loss_or_duplicates(chat):
    c = chat(settings={"max_new_tokens": 120})
    state = {"connections": 0}

    def route(ws):
        state["connections"] += 1
        server = ws.connect_to_server()
        if state["connections"] > 1:
            return  # later connections pass through untouched
        deltas = {"n": 0}

        def from_server(message):
            frame = json.loads(message)
            ws.send(message)
            if frame["type"] == "delta":
                deltas["n"] += 1
                if deltas["n"] == 10:
                    ws.close()
                    server.close()

        server.on_message(from_server)
        ws.on_message(lambda message: server.send(message))

    c.page.route_web_socket("**/ws", route)
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Keep talking through a network blip")
    assert c.wait_done(timeout=60) == "length"
    assert state["connections"] >= 2
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    stored = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()
    assert stored["messages"][-1]["content"] == c.answer()
    assert " · 120 tokens · " in c.page.text_content("[data-testid=stats]")


def test_refused_request_shows_the_error_and_keeps_the_text(chat):
    c = chat()

    def route(ws):
        server = ws.connect_to_server()

        def from_page(message):
            frame = json.loads(message)
            if frame["type"] == "chat":
                ws.send(json.dumps({"type": "error", "id": frame["id"], "code": "rate_limited",
                                    "message": "slow down"}))
            else:
                server.send(message)

        ws.on_message(from_page)

    c.page.route_web_socket("**/ws", route)
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Too fast")
    c.page.wait_for_selector("[data-testid=error]", state="visible")
    assert "too quickly" in c.page.text_content("[data-testid=error]")
    assert c.page.input_value("[data-testid=prompt]") == "Too fast"
    assert c.page.locator("[data-testid=message-user]").count() == 0
    c.shot("error-rate-limited")


def test_sidebar_rename_and_delete(chat):
    c = chat(settings={"max_new_tokens": 8})
    c.send("First question")
    c.wait_done()
    item = "[data-testid=conversation-item]"
    c.page.wait_for_selector(item)
    assert "First question" in c.page.text_content(item)
    c.page.hover(item)
    c.page.click(f"{item} [data-action=menu]")
    c.page.click("[data-testid=menu-rename]")
    c.page.fill(f"{item} input", "Renamed <b>chat</b>")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.getElementById('chat-title').textContent === 'Renamed <b>chat</b>'", 5)
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    assert c.page.request.get(f"{c.url}/api/conversations/{conv}").json()["title"] == "Renamed <b>chat</b>"
    assert c.js("document.querySelectorAll('#conversation-list b').length") == 0
    c.page.reload()
    c.page.wait_for_selector(item)
    assert c.page.text_content(f"{item} .conversation-title") == "Renamed <b>chat</b>"
    c.page.hover(item)
    c.page.click(f"{item} [data-action=menu]")
    c.page.click("[data-testid=menu-delete]")
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 0", 5)
    assert c.dialogs == []  # no confirm box: the trash and Undo keep a slip from costing anything
    assert "moved to the trash" in c.page.text_content("[data-testid=toast]")
    assert c.page.locator("[data-testid=message-user]").count() == 0
    assert c.page.request.get(f"{c.url}/api/conversations/{conv}").status == 404
    assert c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)") is None


def test_settings_are_saved_and_sent(chat):
    c = chat()
    frames = []
    c.page.on("websocket", lambda ws: ws.on("framesent", lambda payload: frames.append(json.loads(payload))))
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.page.click("[data-testid=open-settings]")
    model_name = c.page.text_content("[data-testid=model-name]").strip()
    assert c.page.text_content("[data-testid=settings-model]").strip() == model_name
    c.page.fill("#set-system", "You are terse.")
    c.page.fill("#set-temperature", "0.3")
    c.page.fill("#set-max-tokens", "12")
    c.page.fill("#set-seed", "7")
    c.page.keyboard.press("Escape")
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Hi")
    c.wait_done()
    chat_frame = [f for f in frames if f["type"] == "chat"][-1]
    assert chat_frame["system"] == "You are terse."
    assert chat_frame["params"] == {"temperature": 0.3, "max_new_tokens": 12, "seed": 7}
    assert "12 tokens" in c.page.text_content("[data-testid=stats]")
    c.send("Again")
    c.wait_done()
    follow_up = [f for f in frames if f["type"] == "chat"][-1]
    assert "system" not in follow_up and follow_up["conversation_id"]
