"""Documents in real headless Chromium against the live gunicorn server and its tiny model: a PDF and a
DOCX are read to text by the server, their chips show pages and tokens, the live count adds the draft,
images are refused saying what is accepted, and the model gets the documents' text."""
from __future__ import annotations

import json

from documents import docx, pdf

CHIPS = "[...document.querySelectorAll('[data-testid=pending-attachment]')].map(e => e.textContent)"


def tokens(c, text: str) -> int:
    return c.page.request.post(f"{c.url}/api/tokens", data=json.dumps({"text": text}),
                               headers={"Content-Type": "application/json"}).json()["tokens"]


def test_a_pdf_and_a_docx_are_read_with_pages_and_tokens_and_images_are_refused(chat):
    c = chat(settings={"max_new_tokens": 4})
    c.page.set_input_files("[data-testid=attach-file]", files=[
        {"name": "owls.pdf", "mimeType": "application/pdf", "buffer": pdf(["Owls hunt at night", "Barns"])},
        {"name": "plan.docx", "mimeType": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
         "buffer": docx(["Plan the trip", "Pack the tent"])}])
    c.wait_until(f"() => {CHIPS}.length === 2 && {CHIPS}.every(t => t.includes('tokens'))", 30)
    pdf_text = "[page 1]\nOwls hunt at night\n\n[page 2]\nBarns"
    chips = c.js(CHIPS)
    assert chips[0].startswith("owls.pdf") and f"2 pages · {tokens(c, pdf_text)} tokens" in chips[0], chips
    assert chips[1].startswith("plan.docx") and f"{tokens(c, 'Plan the trip' + chr(10) + 'Pack the tent')} tokens" \
        in chips[1], chips
    # The live count: the draft and the attachments against the context, before sending.
    c.page.fill("[data-testid=prompt]", "Summarize both")
    c.page.dispatch_event("[data-testid=prompt]", "input")
    expected = tokens(c, "Summarize both") + tokens(c, pdf_text) + tokens(c, "Plan the trip\nPack the tent")
    c.wait_until(f"() => document.querySelector('[data-testid=token-count]').textContent"
                 f" === '{expected:,} / 8,192 tokens'", 10)
    c.shot("documents-chips")
    # An image is refused, naming what is accepted; the documents stay.
    c.page.set_input_files("[data-testid=attach-file]", files=[
        {"name": "photo.png", "mimeType": "image/png", "buffer": b"\x89PNG\r\n\x1a\n\x00"}])
    c.wait_until("() => !document.querySelector('[data-testid=error]').hidden")
    error = c.page.text_content("[data-testid=error]")
    assert "is an image" in error and "PDF, DOCX, HTML and CSV" in error
    assert len(c.js(CHIPS)) == 2
    c.page.keyboard.press("Enter")
    c.wait_done()
    conv = c.page.url.rsplit("/", 1)[1]
    user = c.page.request.get(f"{c.url}/api/conversations/{conv}").json()["messages"][0]
    assert user["attachments"] == [{"name": "owls.pdf", "text": pdf_text},
                                   {"name": "plan.docx", "text": "Plan the trip\nPack the tent"}]
    c.wait_until("() => document.querySelector('[data-testid=token-count]').hidden")  # the box is empty again


def test_a_damaged_document_is_said_and_nothing_is_attached(chat):
    c = chat()
    c.page.set_input_files("[data-testid=attach-file]", files=[
        {"name": "broken.pdf", "mimeType": "application/pdf", "buffer": b"%PDF-1.4\n" + b"\x00junk" * 40}])
    c.wait_until("() => !document.querySelector('[data-testid=error]').hidden", 30)
    assert "could not be read" in c.page.text_content("[data-testid=error]")
    c.wait_until(f"() => {CHIPS}.length === 0")
