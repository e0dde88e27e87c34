"""Search in the page marks CJK words inside sentences, at the right place even after characters
that JavaScript counts twice (emoji), in real headless Chromium (Debian's build)."""
from __future__ import annotations

import json

import pytest

SENTENCE = "😀😀 你好，请用中文介绍一下你自己"


@pytest.fixture(scope="module")
def page(app_server, browser):
    """The page in the shared headless Chromium (conftest's ``browser``: Debian's build; the slow tier)."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(app_server.url + "/")
    page.wait_for_selector("[data-testid=connection-status][data-state=open]", timeout=30000)
    yield page
    assert not errors, errors
    context.close()


@pytest.mark.parametrize("query", ["介绍", "中文", "你好"])
def test_cjk_words_are_found_and_marked_in_the_page(app_server, page, query):
    body = {"title": "CJK", "messages": [{"role": "user", "content": SENTENCE}]}
    if not page.evaluate("() => window.__imported === true"):
        response = page.request.post(f"{app_server.url}/api/conversations/import", data=json.dumps(body),
                                     headers={"Content-Type": "application/json"})
        assert response.status == 201
        page.evaluate("() => { window.__imported = true; }")
    page.fill("[data-testid=search]", "")
    page.fill("[data-testid=search]", query)
    page.wait_for_function("q => [...document.querySelectorAll('[data-testid=search-hit] mark')]"
                           ".map(m => m.textContent).join('|') === q", arg=query)
    assert page.text_content("[data-testid=search-hit] .hit-snippet") == SENTENCE
