"""Documents attached on the page, read to text on the server (/api/documents): PDF, DOCX, HTML and CSV
by real libraries in a worker process of their own, bounded; images and other files refused with what
is accepted; a bad file answers an error and the server goes on."""
from __future__ import annotations

import pytest

from chat import create_app, documents
from chat.config import Settings
from chat.store import Store
from chat.web.identity import COOKIE
from documents import docx, pdf
from fakes import FakeEngine

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64


@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(data_dir=str(tmp_path), max_content_chars=2000, rate_limit_per_min=0,
                              rate_limit_per_ip_per_min=0),
                     engine=FakeEngine(), store=Store(str(tmp_path / "chat.db")))
    c = app.test_client()
    c.set_cookie(COOKIE, "alice-client-0123456789")
    return c


def read(client, name: str, data: bytes, content_type: str = "application/octet-stream"):
    return client.post("/api/documents", query_string={"name": name}, data=data, content_type=content_type)


def test_a_pdf_is_read_page_by_page(client):
    response = read(client, "owls.pdf", pdf(["Owls hunt at night", "Barn owls nest in barns"]))
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    assert body["pages"] == 2 and body["truncated"] is False and body["name"] == "owls.pdf"
    assert body["text"] == "[page 1]\nOwls hunt at night\n\n[page 2]\nBarn owls nest in barns"
    assert body["chars"] == len(body["text"]) and body["tokens"] is None  # the fake engine cannot count
    assert response.headers["Cache-Control"] == "no-store"


def test_docx_html_and_csv(client):
    body = read(client, "notes.docx", docx(["First point", "Second point"], [["a", "b"], ["1", "2"]])).get_json()
    assert body["text"] == "First point\nSecond point\na | b\n1 | 2" and body["pages"] is None
    page = b"<html><head><title>T</title><style>p{}</style></head><body><h1>Head</h1><script>evil()</script>" \
           b"<p>One &amp; two</p><table><tr><td>x</td><td>y</td></tr></table></body></html>"
    text = read(client, "page.html", page).get_json()["text"]
    assert "Head" in text and "One & two" in text and "evil" not in text and "p{}" not in text
    table = read(client, "t.csv", "name,age\r\nÅsa,41\r\n".encode("utf-8-sig")).get_json()
    assert table["text"] == "name,age\nÅsa,41\n"


def test_a_csv_with_one_long_cell_is_read(client):
    body = read(client, "wide.csv", b"id,text\n1," + b"z" * 300_000 + b"\n").get_json()
    assert body["truncated"] is True and body["text"].startswith("id,text\n1,zzz")


def test_long_documents_are_cut_at_the_message_limit(client):
    body = read(client, "long.pdf", pdf([f"Page {i} " + "word " * 60 for i in range(20)])).get_json()
    assert body["truncated"] is True and body["chars"] == 2000 and body["pages"] == 20


@pytest.mark.parametrize("name, data, says", [
    ("photo.png", PNG, "is an image"),
    ("photo.pdf", PNG, "is an image"),  # by content too
    ("scan.jpg", b"whatever", "is an image"),
    ("tool.exe", b"MZ\x90\x00", "not a document"),
    ("fake.pdf", b"hello, not a pdf", "not a PDF file inside"),
    ("fake.docx", b"hello", "not a DOCX file inside"),
    ("broken.pdf", b"%PDF-1.4\n" + b"\x00garbage" * 50, "could not be read"),
    ("broken.docx", b"PK\x03\x04" + b"\x00" * 100, "could not be read"),
])
def test_what_is_not_read_is_said(client, name, data, says):
    response = read(client, name, data)
    assert response.status_code == 400 and says in response.get_json()["error"]["message"], response.get_json()
    if "image" in says or "not a document" in says:
        assert "PDF, DOCX, HTML and CSV" in response.get_json()["error"]["message"]
    assert read(client, "ok.csv", b"a,b").status_code == 200  # and the server goes on


def test_bounds(client, monkeypatch):
    assert read(client, "a.csv", b"a,b", content_type="text/plain").status_code == 400  # a form could post that
    assert read(client, "", b"a,b").status_code == 400
    assert read(client, "big.csv", b"a" * (10 * 2**20 + 1)).status_code == 413
    monkeypatch.setattr(documents, "TIMEOUT_S", 0.01)  # no worker starts that fast
    response = read(client, "slow.pdf", pdf(["x"]))
    assert response.status_code == 413 and "took longer" in response.get_json()["error"]["message"]


def test_tokens_are_counted_by_the_engine(client):
    response = client.post("/api/tokens", json={"text": "hello there"})
    assert response.status_code == 200 and response.get_json() == {"tokens": None}  # the fake cannot say
    assert client.post("/api/tokens", json={"text": 5}).status_code == 400
