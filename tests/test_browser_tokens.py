"""Token probabilities on the page (real headless Chromium, live gunicorn server): with the setting on,
an answer's Probabilities action shows its tokens; hovering one shows its probability and the
alternatives the model weighed. Off, nothing is asked for."""
from __future__ import annotations

import json


def test_token_probabilities_on_demand(chat):
    c = chat(settings={"max_new_tokens": 8})
    sent = []
    c.page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    c.send("Hello?")
    c.wait_done()
    assert c.page.locator("[data-testid=show-probabilities]").count() == 0  # off by default
    assert "logprobs" not in (sent[-1].get("params") or {})

    c.page.click("[data-testid=open-settings]")
    c.page.check("[data-testid=set-token-probs]")
    c.page.keyboard.press("Escape")
    c.send("Hello again?")
    c.wait_done()
    chats = [f for f in sent if f.get("type") == "chat"]
    assert chats[-1]["params"]["logprobs"] is True and chats[-1]["params"]["top_logprobs"] == 5
    last = c.page.locator("[data-testid=message-assistant]").last
    last.locator("[data-testid=show-probabilities]").click()
    tokens = last.locator("[data-testid=token]")
    assert tokens.count() >= 1
    answer = c.js("""() => [...document.querySelectorAll('[data-testid=message-assistant]')].pop()
                      .querySelector('.msg-body').textContent""")
    assert "".join(tokens.all_text_contents()).strip() == answer.strip()
    tokens.first.hover()
    tip = c.page.locator("[data-testid=token-tip]")
    tip.wait_for(state="visible")
    assert "%" in tip.text_content()
    assert tip.locator("[data-testid=token-alternative]").count() == 5
    c.shot("token-probabilities")
    last.locator("[data-testid=token]").nth(0).blur()
    c.page.mouse.move(0, 0)
    assert tip.is_hidden()
    # Continue (the answer was cut at 8 tokens) asks for them too, and the new tokens join the old
    before = tokens.count()
    last.locator("[data-testid=continue]").click()
    c.wait_until("() => [...document.querySelectorAll('[data-testid=message-assistant]')].pop()"
                 ".dataset.state === 'done'")
    assert [f for f in sent if f.get("type") == "continue"][-1]["params"]["logprobs"] is True
    last.locator("[data-testid=show-probabilities]").click()
    assert last.locator("[data-testid=token]").count() > before
    # the setting stays for the next visit
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    assert c.js("document.getElementById('set-token-probs').checked")
