"""Presets in real headless Chromium against the live gunicorn server: save the dialog's settings
under a name, choose it for one chat (its next turns use it) and for new chats, delete it."""
from __future__ import annotations

import json


def test_a_preset_is_saved_and_chosen_per_chat(chat):
    c = chat(settings={"max_new_tokens": 6})
    frames = []
    c.page.on("websocket", lambda ws: ws.on("framesent", lambda payload: frames.append(json.loads(payload))))
    c.page.reload()
    c.page.wait_for_selector("[data-testid=connection-status][data-state=open]")
    # Defaults dialog: write settings, save them as a preset.
    c.page.click("[data-testid=open-settings]")
    c.page.fill("#set-system", "You answer like a pirate.")
    c.page.fill("#set-max-tokens", "5")
    c.page.fill("[data-testid=preset-name]", "Pirate")
    c.page.keyboard.press("Enter")  # saves; the dialog stays open
    c.wait_until("() => document.querySelector('[data-testid=preset-help]').textContent.includes('Saved')")
    assert c.js("document.getElementById('settings').open")
    assert c.page.request.get(f"{c.url}/api/presets").json()[0]["system"] == "You answer like a pirate."
    c.page.click("#settings-reset")
    assert c.page.input_value("#set-system") == ""
    c.page.fill("#set-max-tokens", "6")
    c.page.keyboard.press("Escape")

    # A chat started with the defaults, then switched to the preset in its own settings.
    c.send("Ahoy?")
    c.wait_done()
    c.page.click("[data-testid=conversation-menu] summary")
    c.page.click("[data-testid=open-chat-settings]")
    c.wait_until("() => document.querySelectorAll('[data-testid=preset-pick] option').length === 2")
    c.page.select_option("[data-testid=preset-pick]", label="Pirate")
    assert c.page.input_value("#set-system") == "You answer like a pirate."
    conv = c.js("((location.pathname.match(/^\\/c\\/([^/]+)/) || [])[1] || null)")
    c.wait_until(f"""() => fetch('/api/conversations/{conv}').then(r => r.json())
                     .then(x => x.system === 'You answer like a pirate.' && x.params.max_new_tokens === 5)""")
    c.shot("presets-1280")
    c.page.keyboard.press("Escape")
    c.send("And now?")
    c.wait_done()
    assert "5 tokens" in c.page.text_content("[data-testid=message-assistant] >> nth=-1 >> [data-testid=stats]")

    # Deleting the preset leaves the chat's settings as they are.
    c.page.click("[data-testid=open-settings]")
    c.wait_until("() => document.querySelectorAll('[data-testid=preset-pick] option').length === 2")
    c.page.select_option("[data-testid=preset-pick]", label="Pirate")
    c.page.click("[data-testid=preset-delete]")
    c.wait_until("() => document.querySelectorAll('[data-testid=preset-pick] option').length === 1")
    assert c.page.request.get(f"{c.url}/api/presets").json() == []
    assert c.page.request.get(f"{c.url}/api/conversations/{conv}").json()["system"] == "You answer like a pirate."
