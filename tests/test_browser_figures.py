"""Live figures, in real headless Chromium against the live gunicorn server: tokens so far and
tokens/s while an answer streams, the share of the context a turn used, and after Continue the
figures of the whole answer."""
from __future__ import annotations

import json
import re

LAST = "[...document.querySelectorAll('[data-testid=message-assistant]')].pop()"
CURRENT = "((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)"


def test_figures_while_streaming_and_after_continue(chat):
    c = chat(settings={"max_new_tokens": 4000})
    c.js(f"""() => {{ window.__live = [];
        new MutationObserver(() => {{
          const line = {LAST}?.querySelector('[data-testid=live-stats]');
          if (line) window.__live.push(line.textContent);
        }}).observe(document.getElementById('thread'), {{subtree: true, childList: true, characterData: true}}); }}""")
    frames = []
    c.page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.js(f"""() => {{ window.__live = [];
        new MutationObserver(() => {{
          const line = {LAST}?.querySelector('[data-testid=live-stats]');
          if (line) window.__live.push(line.textContent);
        }}).observe(document.getElementById('thread'), {{subtree: true, childList: true, characterData: true}}); }}""")
    c.send("Go on for a while")
    c.wait_until("() => window.__live.some(t => t.includes('tokens/s'))", 30)
    counts = [int(re.search(r"≈ (\d+) tokens so far", t).group(1)) for t in c.js("window.__live")]
    assert counts == sorted(counts) and counts[-1] > counts[0], counts
    c.shot("live-figures")
    c.page.click("[data-testid=stop]")
    assert c.wait_done(timeout=20) == "cancelled"
    conv = c.js(CURRENT)
    first = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()["messages"][-1]["usage"]
    # The live count is the engine's own (the deltas' `tokens`), which ends where `done` says.
    counted = [f["tokens"] for f in frames if f.get("type") == "delta"]
    assert counted and counted[-1] == first["completion_tokens"], (counted[-3:], first)
    shown = {int(re.search(r"≈ (\d+) tokens so far", t).group(1)) for t in c.js("window.__live")}
    assert shown <= set(counted) and len(shown) > 1, (shown, counted)
    stats = c.page.text_content("[data-testid=stats]")
    assert f"{first['completion_tokens']} tokens" in stats and "% of the context" in stats
    assert c.page.locator("[data-testid=live-stats]").count() == 0

    c.js("() => { window.__live = []; }")
    c.page.click("[data-testid=continue]")
    c.wait_until("() => window.__live.length > 3", 30)
    # Live, the count goes on from the first part's tokens.
    assert int(re.search(r"≈ (\d+) tokens", c.js("window.__live")[-1]).group(1)) > first["completion_tokens"]
    c.page.click("[data-testid=stop]")
    assert c.wait_done(timeout=20) == "cancelled"
    c.wait_until(f"() => {LAST}.dataset.id")
    whole = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()["messages"][-1]["usage"]
    assert whole["completion_tokens"] > first["completion_tokens"]
    assert f"{whole['completion_tokens']} tokens" in c.page.text_content("[data-testid=stats]")
    c.page.reload()
    c.page.wait_for_selector("[data-testid=stats]")
    assert f"{whole['completion_tokens']} tokens" in c.page.text_content("[data-testid=stats]")
    # The share of the context shows on a reloaded page too (the conversation may draw before `ready`).
    c.wait_until("() => document.querySelector('[data-testid=stats]').textContent.includes('% of the context')", 10)
