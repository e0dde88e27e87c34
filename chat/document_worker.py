"""python -m chat.document_worker KIND MAX_PAGES MAX_CHARS: one attached document (PDF, DOCX, HTML, CSV)
read from stdin to text, printed as JSON {"text", "pages", "truncated"} (or {"error"}).

A process of its own per document (chat/documents.py starts it with memory and CPU limits and a
time limit): a malformed or hostile file costs this process alone, never the server's event loop.
"""
from __future__ import annotations

import csv
import io
import json
import sys
from html.parser import HTMLParser


class _Text(HTMLParser):
    """The visible text of an HTML page: no scripts or styles, a line per block."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article",
              "pre", "blockquote", "table", "ul", "ol", "header", "footer", "title"}
    HIDDEN = {"script", "style", "noscript", "template", "head"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.HIDDEN:
            self.hidden += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" | ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def _decode(data: bytes) -> str:
    for encoding in ("utf-8-sig", "utf-16") if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ("utf-8-sig",):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    return data.decode("cp1252", errors="replace")


def _tidy(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def pdf(data: bytes, max_pages: int, max_chars: int) -> tuple[str, int, bool]:
    from pypdf import PdfReader
    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):
        raise ValueError("the PDF is protected by a password")
    pages = len(reader.pages)
    texts, size, truncated = [], 0, pages > max_pages
    for number, page in enumerate(reader.pages[:max_pages], start=1):
        text = _tidy(page.extract_text() or "")
        texts.append(f"[page {number}]\n{text}" if pages > 1 else text)
        size += len(texts[-1])
        if size > max_chars:
            truncated = truncated or number < pages
            break
    return "\n\n".join(texts), pages, truncated


def docx(data: bytes, max_pages: int, max_chars: int) -> tuple[str, None, bool]:
    from docx import Document
    document = Document(io.BytesIO(data))
    parts: list[str] = []
    size = 0
    body = document.element.body
    for child in body.iterchildren():
        tag = child.tag.rsplit("}", 1)[-1]
        if tag == "p":
            text = "".join(node.text or "" for node in child.iter() if node.tag.endswith("}t"))
        elif tag == "tbl":
            rows = []
            for row in child.iter():
                if row.tag.endswith("}tr"):
                    cells = ["".join(t.text or "" for t in cell.iter() if t.tag.endswith("}t"))
                             for cell in row if cell.tag.endswith("}tc")]
                    rows.append(" | ".join(" ".join(c.split()) for c in cells))
            text = "\n".join(rows)
        else:
            continue
        parts.append(text)
        size += len(text) + 1
        if size > max_chars:
            return _tidy("\n".join(parts)), None, True
    return _tidy("\n".join(parts)), None, False


def html(data: bytes, max_pages: int, max_chars: int) -> tuple[str, None, bool]:
    parser = _Text()
    parser.feed(_decode(data))
    parser.close()
    return _tidy("".join(parser.parts)), None, False


def csv_(data: bytes, max_pages: int, max_chars: int) -> tuple[str, None, bool]:
    text = _decode(data).replace("\r\n", "\n")
    csv.field_size_limit(len(text) + 1)  # one long cell is still a table (the worker's bounds hold)
    for _ in csv.reader(io.StringIO(text)):  # a malformed file fails here, with csv's own words
        pass
    return text, None, False  # as written: the model reads CSV as well as any table


KINDS = {"pdf": pdf, "docx": docx, "html": html, "csv": csv_}


def main(argv: list[str]) -> int:
    kind, max_pages, max_chars = argv[0], int(argv[1]), int(argv[2])
    data = sys.stdin.buffer.read()
    try:
        text, pages, truncated = KINDS[kind](data, max_pages, max_chars)
    except Exception as exc:  # any failure of a library on a bad file: said, never raised
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:300]}))
        return 0
    if len(text) > max_chars:
        text, truncated = text[:max_chars], True
    print(json.dumps({"text": text, "pages": pages, "truncated": truncated}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
