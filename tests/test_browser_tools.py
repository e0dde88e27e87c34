"""The page shows a tool call in an answer as a collapsible block (real Chromium)."""
from __future__ import annotations

CALL = 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n\nDone.'


def test_tool_call_is_a_collapsible_block(chat):
    c = chat()
    out = c.js("""async (src) => {
        const base = document.querySelector('script[type=module]').src;
        const md = await import(new URL('markdown.js', base).href);
        const render = (s) => {
            const d = document.createElement('div');
            d.innerHTML = md.renderMarkdownToHtml(s);
            return d;
        };
        const whole = render(src), partial = render(src.slice(0, src.indexOf('"arguments"')));
        const block = whole.querySelector('details.tool-call');
        return { blocks: whole.querySelectorAll('details.tool-call').length, open: block.open,
                 summary: block.querySelector('summary').textContent, args: block.querySelector('pre').textContent,
                 paragraphs: [...whole.querySelectorAll('p')].map((p) => p.textContent),
                 partial: partial.querySelectorAll('details.tool-call').length };
    }""", CALL)
    assert out["blocks"] == 1 and out["open"] is False
    assert out["summary"] == "Tool call: get_weather"
    assert '"city": "Oslo"' in out["args"]
    assert out["paragraphs"] == ["Let me check.", "Done."]
    assert out["partial"] == 1  # still streaming: shown as a block already
