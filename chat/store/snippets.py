"""Search snippets: a short window of a message around its first match, with the matches' offsets.

Cut here rather than by the database (FTS5's snippet(), ts_headline) so the work is bounded by the
window, whatever the size of the message or the number of its matches, and both backends mark the
same words. Matching folds case and Latin diacritics one character for one, so offsets found in the
folded text are offsets in the original.
"""
from __future__ import annotations

import functools
import re
import unicodedata

SNIPPET_CHARS = 160  # the window's length, before the ellipses
BEFORE_CHARS = 40  # of it, how much comes before the first match
WORD_SLACK = 15  # how far a cut may move to fall between two words
ELLIPSIS = "…"
_TOKEN = r"[^\W_]"  # a word character as the full-text tokenizers see it (letters and digits)


@functools.cache
def fold_table() -> dict[int, str]:
    """Characters whose lowercase, diacritics-free form is one other character (U+0000-2FFF)."""
    table = {}
    for cp in range(0x3000):
        ch = chr(cp)
        base = "".join(c for c in unicodedata.normalize("NFD", ch) if not unicodedata.combining(c)) or ch
        low = base.lower()
        if len(low) == 1 and low != ch:
            table[cp] = low
    return table


def fold(text: str) -> str:
    """``text`` lowercased and without Latin diacritics, character for character (same length)."""
    return text.translate(fold_table())


def pattern(words: list[str], prefix: str | None, runs: list[str]) -> re.Pattern | None:
    """What to mark: whole ``words``, a word starting with ``prefix`` (the word being typed), and
    CJK ``runs`` anywhere; None when there is nothing."""
    parts = [f"(?<!{_TOKEN}){re.escape(fold(w))}(?!{_TOKEN})" for w in words]
    if prefix:
        parts.append(f"(?<!{_TOKEN}){re.escape(fold(prefix))}{_TOKEN}*")
    parts += [re.escape(r) for r in runs]
    return re.compile("|".join(parts)) if parts else None


def _cut_start(text: str, at: int) -> int:
    """``at``, moved forward to the start of a word when one starts close by."""
    if at <= 0:
        return 0
    space = text.find(" ", at, at + WORD_SLACK)
    return space + 1 if space >= 0 else at


def _cut_end(text: str, at: int) -> int:
    """``at``, moved back to the end of a word when one ends close by."""
    if at >= len(text):
        return len(text)
    space = text.rfind(" ", at - WORD_SLACK, at)
    return space if space > 0 else at


def snippet(text: str, marks: re.Pattern | None) -> tuple[str, list[list[int]]]:
    """(snippet, [[start, end], ...]): about SNIPPET_CHARS of ``text`` around its first match,
    with "…" where it was cut, and the character offsets of every match inside it."""
    folded = fold(text)
    first = marks.search(folded) if marks is not None else None
    start = _cut_start(text, first.start() - BEFORE_CHARS) if first else 0
    end = _cut_end(text, start + SNIPPET_CHARS)
    head = ELLIPSIS if start > 0 else ""
    spans = []
    if marks is not None:
        for match in marks.finditer(folded, start, end):
            if match.end() > match.start():
                spans.append([len(head) + match.start() - start, len(head) + match.end() - start])
    return head + text[start:end] + (ELLIPSIS if end < len(text) else ""), spans
