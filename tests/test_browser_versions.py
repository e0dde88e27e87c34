"""The page's versions, edit, continue, search, import and attachments, in real headless Chromium."""
from __future__ import annotations

import json
import statistics

from helpers import ARTIFACTS

LAST_ASSISTANT = "[...document.querySelectorAll('[data-testid=message-assistant]')].pop()"


def current_conversation(c) -> str:
    return c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")


def stored(c, conv=None) -> dict:
    return c.page.request.get(f"{c.url}/api/conversations/{conv or current_conversation(c)}").json()


def user_texts(c) -> list[str]:
    return c.js("[...document.querySelectorAll('[data-testid=message-user] .msg-body')].map(e => e.textContent)")


def import_json(c, body: dict, name: str = "export.json") -> None:
    c.page.set_input_files("[data-testid=import-file]", files=[
        {"name": name, "mimeType": "application/json", "buffer": json.dumps(body).encode()}])


def test_edit_and_branch_with_version_switching(chat):
    c = chat(settings={"max_new_tokens": 8, "temperature": 0})
    c.send("First question")
    c.wait_done()
    c.send("Second question")
    c.wait_done()
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user][data-id]').length === 2")
    second = "[data-testid=message-user] >> nth=1"
    old_answer = c.answer()
    # Esc puts the message back and sends nothing
    c.page.hover(second)
    c.page.click(f"{second} >> [data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "never sent")
    c.page.keyboard.press("Escape")
    assert user_texts(c) == ["First question", "Second question"]
    assert c.page.locator("[data-testid=edit-box]").count() == 0
    # Enter sends the edit as a new version; its answer replaces the path below
    c.page.hover(second)
    c.page.click(f"{second} >> [data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "Second question, edited")
    c.page.keyboard.press("Enter")
    c.wait_until(f"() => {LAST_ASSISTANT}.dataset.state === 'done' && "
                 "document.querySelectorAll('[data-testid=versions]').length === 1")
    assert user_texts(c) == ["First question", "Second question, edited"]
    assert c.page.locator("[data-testid=message-assistant]").count() == 2
    assert c.page.text_content("[data-testid=versions] .versions-label") == "2/2"
    # switching back shows the old question and the answer below it, and forth again
    c.page.click("[data-testid=versions] [data-action=version-prev]")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '1/2'")
    assert user_texts(c) == ["First question", "Second question"]
    assert c.answer() == old_answer
    assert [m["content"] for m in stored(c)["messages"]][2] == "Second question"
    c.page.click("[data-testid=versions] [data-action=version-next]")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '2/2'")
    assert user_texts(c) == ["First question", "Second question, edited"]
    # regenerate adds an answer version with its own switcher
    c.page.click("[data-testid=regenerate]:visible")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 2")
    assert c.page.text_content("[data-testid=message-assistant] >> nth=1 >> .versions-label") == "2/2"
    c.page.reload()
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 2")
    c.shot("versions")


def test_continue_extends_the_answer(chat):
    c = chat(settings={"max_new_tokens": 8, "temperature": 0})
    c.send("Tell me a long story")
    assert c.wait_done() == "length"
    first = c.answer()
    c.page.click("[data-testid=continue]")
    c.wait_until(f"() => {LAST_ASSISTANT}.dataset.state === 'done' && {LAST_ASSISTANT}.view.text.length > {len(first)}")
    assert c.answer().startswith(first)
    assert c.page.locator("[data-testid=message-assistant]").count() == 1
    c.wait_until(f"() => {LAST_ASSISTANT}.dataset.id")
    assert stored(c)["messages"][-1]["content"] == c.answer()


def test_search_as_you_type_and_open(chat):
    c = chat(settings={"max_new_tokens": 4})
    c.send("Where do zebras <b>sleep</b>?")
    c.wait_done()
    target = current_conversation(c)
    c.page.click("[data-testid=new-chat]")
    c.send("Something else entirely")
    c.wait_done()
    c.page.fill("[data-testid=search]", "zebr")
    c.wait_until("() => document.querySelectorAll('[data-testid=search-hit]').length === 1")
    hit = "[data-testid=search-hit]"
    assert c.page.text_content(f"{hit} mark") == "zebras"
    assert "<b>sleep</b>" in c.page.text_content(f"{hit} .hit-snippet")
    assert c.js("document.querySelectorAll('[data-testid=search-results] b').length") == 0
    assert c.page.is_hidden("#conversation-list")
    c.page.click(hit)
    c.wait_until(f"() => ((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null) === '{target}'")
    c.wait_until("() => document.querySelector('.msg.found')")
    assert user_texts(c) == ["Where do zebras <b>sleep</b>?"]
    c.page.fill("[data-testid=search]", "")
    c.wait_until("() => !document.getElementById('conversation-list').hidden")
    # a match on another branch: opening it switches to that branch
    c.wait_until("() => document.querySelector('[data-testid=message-user][data-id]')")
    c.page.hover("[data-testid=message-user]")
    c.page.click("[data-testid=edit]")
    c.page.fill("[data-testid=edit-box]", "Where do giraffes sleep?")
    c.page.keyboard.press("Enter")
    c.wait_until("() => document.querySelectorAll('[data-testid=versions]').length === 1")
    c.page.fill("[data-testid=search]", "zebras")
    c.wait_until("() => document.querySelectorAll('[data-testid=search-hit]').length === 1")
    c.page.click("[data-testid=search-hit]")
    c.wait_until("() => document.querySelector('[data-testid=versions] .versions-label')?.textContent === '1/2'")
    assert user_texts(c) == ["Where do zebras <b>sleep</b>?"]
    c.page.fill("[data-testid=search]", "")
    c.page.fill("[data-testid=search]", "nothingmatchesthis")
    c.wait_until("() => document.querySelector('[data-testid=search-results]').textContent.includes('No matches')")


def test_import_of_an_exported_file(chat):
    c = chat(settings={"max_new_tokens": 6})
    c.send("Remember this")
    c.wait_done()
    conv = current_conversation(c)
    exported = c.page.request.get(f"{c.url}/api/conversations/{conv}/export?format=json").json()
    import_json(c, exported)
    c.wait_until(f"() => (((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null) || '{conv}') !== '{conv}'")
    c.wait_until("() => document.querySelectorAll('[data-testid=conversation-item]').length === 2")
    new = current_conversation(c)
    c.wait_until(f"() => {LAST_ASSISTANT}?.view.text === {json.dumps(exported['messages'][1]['content'])}")
    assert user_texts(c) == ["Remember this"]
    keep = ("role", "content", "status", "reason", "usage", "timings", "created_at", "attachments")
    assert [{k: m[k] for k in keep} for m in stored(c, new)["messages"]] == \
        [{k: m[k] for k in keep} for m in exported["messages"]]
    # a file that is not an export is refused with a message
    import_json(c, {"not": "an export"}, "bad.json")
    c.wait_until("() => !document.querySelector('[data-testid=error]').hidden")
    assert "Could not import" in c.page.text_content("[data-testid=error]")


def test_attach_files_by_button_and_drop_and_refuse_binary(chat):
    c = chat(settings={"max_new_tokens": 4})
    c.page.set_input_files("[data-testid=attach-file]", files=[
        {"name": "notes.txt", "mimeType": "text/plain", "buffer": "alpha\nbeta <b>x</b>\n".encode()}])
    c.wait_until("() => document.querySelectorAll('[data-testid=pending-attachment]').length === 1")
    c.js("""() => { const dt = new DataTransfer();
        dt.items.add(new File(['col1,col2\\n1,2\\n'], 'table.csv', {type: 'text/csv'}));
        document.getElementById('prompt').dispatchEvent(
          new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})); }""")
    c.wait_until("() => document.querySelectorAll('[data-testid=pending-attachment]').length === 2")
    c.js("""() => { const dt = new DataTransfer();
        dt.items.add(new File(['pasted text'], 'clip.txt', {type: 'text/plain'}));
        document.getElementById('prompt').dispatchEvent(
          new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true})); }""")
    c.wait_until("() => document.querySelectorAll('[data-testid=pending-attachment]').length === 3")
    c.page.click("[data-testid=pending-attachment] >> nth=2 >> .chip-remove")
    c.wait_until("() => document.querySelectorAll('[data-testid=pending-attachment]').length === 2")
    c.page.set_input_files("[data-testid=attach-file]", files=[
        {"name": "photo.txt", "mimeType": "text/plain", "buffer": b"\x89PNG\r\n\x1a\n\x00\x00\x00"}])
    c.wait_until("() => !document.querySelector('[data-testid=error]').hidden")
    assert "not a file this page can read" in c.page.text_content("[data-testid=error]")
    assert c.page.locator("[data-testid=pending-attachment]").count() == 2
    c.wait_until("() => !document.querySelector('.file-chip.reading')")  # table.csv is read by the server
    c.send("Summarize these files")
    c.wait_done()
    assert c.page.locator("[data-testid=pending-attachment]").count() == 0
    chips = c.js("[...document.querySelectorAll('[data-testid=message-user] [data-testid=attachment] summary')]"
                 ".map(e => e.textContent)")
    assert chips == ["notes.txt", "table.csv"]
    assert c.js("document.querySelectorAll('#thread .msg-files b').length") == 0
    user = stored(c)["messages"][0]
    assert user["attachments"] == [{"name": "notes.txt", "text": "alpha\nbeta <b>x</b>\n"},
                                   {"name": "table.csv", "text": "col1,col2\n1,2\n"}]
    c.page.reload()
    c.wait_until("() => document.querySelectorAll('[data-testid=message-user] [data-testid=attachment]').length === 2")


def _long_conversation(messages: int = 300, answer_words: int = 2990) -> dict:
    """An export-shaped conversation: ``messages`` turns, the last a long answer cut by length."""
    paragraph = ("The quick brown fox jumps over the lazy dog while **streaming** tokens keep arriving, "
                 "and each `frame` should cost only the block that changed. ")
    turns = []
    for i in range(messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": f"Message {i}: " + paragraph * (1 if role == "user" else 3)})
    words, blocks = 0, []
    while words < answer_words:
        blocks.append(paragraph * 3 if len(blocks) % 5 else "- item one\n- item two\n- item three")
        words += len(blocks[-1].split())
    turns.append({"role": "assistant", "content": "\n\n".join(blocks), "status": "complete", "reason": "length"})
    return {"title": "Long", "messages": turns}


def test_streaming_into_a_long_answer_in_a_300_message_conversation(chat):
    c = chat(settings={"max_new_tokens": 80, "temperature": 0.8, "seed": 1})
    c.js("() => { window.__importAt = performance.now(); }")
    import_json(c, _long_conversation(), "long.json")
    c.wait_until("() => document.querySelectorAll('.msg').length === 300", 60)
    opened_ms = c.js("() => new Promise((done) =>"
                     " requestAnimationFrame(() => done(performance.now() - window.__importAt)))")
    # scrolling the whole thread up, a step per frame
    scroll = c.js("""() => new Promise((done) => {
        const box = document.getElementById('messages'); const frames = []; let last = performance.now();
        const step = (now) => { frames.push(now - last); last = now; box.scrollTop -= 600;
          if (box.scrollTop > 0) requestAnimationFrame(step);
          else { box.scrollTop = box.scrollHeight; done(frames); } };
        requestAnimationFrame(step); })""")
    c.wait_until("() => document.querySelector('[data-testid=continue]')"
                 " && !document.querySelector('[data-testid=continue]').hidden")
    c.js("""() => {
        window.__frames = []; window.__renders = [];
        window.__blocksBefore = [...document.querySelectorAll('.msg')].pop().querySelectorAll('.md-block');
        new PerformanceObserver((list) => { for (const e of list.getEntries()) window.__renders.push(e.duration); })
            .observe({ entryTypes: ['measure'] });
        let last = performance.now();
        const tick = (now) => { window.__frames.push(now - last); last = now;
          if (!window.__stopFrames) requestAnimationFrame(tick); };
        requestAnimationFrame(tick); }""")
    c.page.click("[data-testid=continue]")
    c.wait_done(120)
    c.js("() => { window.__stopFrames = true; }")
    frames, renders = c.js("window.__frames"), c.js("window.__renders")
    # the finished blocks of the answer kept their DOM nodes: only the growing block was redrawn
    kept = c.js("""() => { const now = [...document.querySelectorAll('.msg')].pop().querySelectorAll('.md-block');
                          const before = [...window.__blocksBefore];
                          return before.slice(0, -1).every((node, i) => now[i] === node); }""")
    assert kept and renders, (kept, len(renders))
    # the same growing text drawn incrementally, and as the old code did (lexing the whole answer
    # every frame); report only, for comparison
    incremental, full_relex = c.js("""async () => {
        const { MarkdownView } = await import('/static/js/markdown.js');
        const text = [...document.querySelectorAll('.msg')].pop().view.text;
        const run = (relexAll) => {
          const view = new MarkdownView(document.createElement('div'));
          view.update(text.slice(0, -40), false);
          const times = [];
          for (let i = 0; i < 30; i++) {
            if (relexAll) { view.stableChars = 0; view.stableBlocks = 0; }
            const t = performance.now(); view.update(text.slice(0, -39 + i), false); times.push(performance.now() - t);
          }
          return times;
        };
        return [run(false), run(true)]; }""")
    report = {"frames": len(frames), "frame_ms_median": statistics.median(frames), "frame_ms_max": max(frames),
              "render_ms_median": statistics.median(renders), "render_ms_max": max(renders),
              "update_ms_median": statistics.median(incremental),
              "update_ms_median_relexing_all": statistics.median(full_relex),
              "answer_chars": len(c.answer()), "messages": 300,
              "import_and_open_ms": opened_ms, "scroll_frames": len(scroll),
              "scroll_frame_ms_median": statistics.median(scroll), "scroll_frame_ms_max": max(scroll)}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "long-stream-frames.json").write_text(json.dumps(report, indent=2))
    print("long conversation streaming:", json.dumps(report))
