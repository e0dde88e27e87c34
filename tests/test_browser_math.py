"""Math and copying, in real headless Chromium against the live gunicorn server: $…$, $$…$$, \\(…\\)
and \\[…\\] rendered by the vendored KaTeX as MathML under the page's CSP (money stays text, TeX
cannot make links), and a whole conversation copied as Markdown."""
from __future__ import annotations

import json

import pytest
from helpers import Chat

ANSWER = ("Euler: $e^{i\\pi} + 1 = 0$. It costs $5 and $10.\n\n"
          "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$\n\n"
          "Also \\(a^2 + b^2 = c^2\\) and a link try: $\\href{javascript:alert(1)}{click}$.\n\n"
          "\\[\\sum_{n=1}^{\\infty} \\frac{1}{n^2} = \\frac{\\pi^2}{6}\\]\n")


def open_imported(c, messages) -> str:
    conv = c.page.request.post(f"{c.url}/api/conversations/import", data=json.dumps({"messages": messages}),
                               headers={"Content-Type": "application/json"}).json()["id"]
    c.page.goto(f"{c.url}/c/{conv}")
    c.page.wait_for_selector("[data-testid=message-assistant]")
    return conv


@pytest.mark.parametrize("width, scheme", [(1280, "light"), (375, "dark")])
def test_math_renders_as_mathml_and_money_stays_text(browser, server, width, scheme):
    context = browser.new_context(viewport={"width": width, "height": 800}, color_scheme=scheme)
    c = Chat(browser, server.url, context=context)
    try:
        c.open()
        open_imported(c, [{"role": "user", "content": "Some math?"}, {"role": "assistant", "content": ANSWER}])
        body = "[data-testid=message-assistant] .msg-body"
        c.wait_until(f"() => document.querySelectorAll('{body} math').length === 5")
        assert c.js(f"document.querySelectorAll('{body} .math-block math[display=block]').length") == 2
        text = c.page.text_content(body)
        assert "It costs $5 and $10." in text
        assert "$e^" not in text and "\\int" not in text and "\\frac" not in text
        assert c.js(f"document.querySelectorAll('{body} a').length") == 0, "TeX made a link"
        assert c.js(f"[...document.querySelectorAll('{body} [style]')].length") == 0
        assert c.js(f"document.querySelector('{body} .math-block').getBoundingClientRect().height") > 20
        # Displayed math is centred in the answer's column.
        offsets = c.js(f"""[...document.querySelectorAll('{body} .math-block math')].map(m => {{
            const r = m.getBoundingClientRect(), box = m.closest('.msg-body').getBoundingClientRect();
            return [(r.left + r.right) / 2 - (box.left + box.right) / 2, r.width, box.width]; }})""")
        assert all(abs(centre) < 2 and width < full for centre, width, full in offsets), offsets
        c.shot(f"math-{width}-{scheme}")
        assert not c.errors, c.errors  # no CSP report, no exception
    finally:
        context.close()


def test_a_conversation_copies_as_markdown(chat):
    c = chat()
    c.context.grant_permissions(["clipboard-read", "clipboard-write"])
    conv = open_imported(c, [{"role": "user", "content": "Copy me"}, {"role": "assistant", "content": "**Bold** answer"}])  # noqa: E501
    c.page.click("[data-testid=conversation-menu] summary")
    c.page.click("[data-testid=copy-markdown]")
    expected = c.page.request.get(f"{c.url}/api/conversations/{conv}/export?format=md").text()
    c.wait_until("(md) => navigator.clipboard.readText().then(t => t === md)", 10, expected)
    assert "Copy me" in expected and "**Bold** answer" in expected


def test_plain_text_in_a_fence_is_not_labelled_css(chat):
    c = chat()
    labels = c.js("""async () => {
        const { renderMarkdownToHtml } = await import('/static/js/markdown.js');
        const label = (md) => new DOMParser().parseFromString(renderMarkdownToHtml(md), 'text/html')
            .querySelector('.code-lang').textContent;
        return [label('```\\nPlease remember: the meeting is at noon; bring the notes.\\nColor: blue; size: large.\\n```'),
                label('```\\nimport os\\n\\ndef main():\\n    for name in os.listdir(\\'.\\'):\\n        print(f"{name}")\\n\\nif __name__ == "__main__":\\n    main()\\n```'),
                label('```css\\nbody { color: red; }\\n```')];
    }""")  # noqa: E501
    assert labels == ["text", "python", "css"]
    # Every grammar at once called that plain text CSS (the bug): the narrower set does not.
    assert c.js("""async () => { const { default: hljs } = await import('/static/vendor/highlight/highlight.min.js');
        return hljs.highlightAuto('Please remember: the meeting is at noon; bring the notes.\\nColor: blue; size: large.').language; }""") == "css"  # noqa: E501
