"""Full-text search (SQLite FTS5) over one client's messages: plain snippets with offsets."""
from __future__ import annotations

import re

MAX_RESULTS = 50
SNIPPET_TOKENS = 24
# Private-use characters mark matches inside FTS5's snippet; they are removed before it leaves.
_OPEN, _CLOSE = "\ue000", "\ue001"
_WORD = re.compile(r"\w+")


def match_query(text: str) -> str | None:
    """An FTS5 query for what a person typed: every word must occur, the last one as a prefix
    (results as you type); None when there is no word. Quoting keeps FTS5 syntax inert."""
    words = _WORD.findall(text or "")[:16]
    if not words:
        return None
    terms = [f'"{w}"' for w in words]
    terms[-1] += "*"
    return " ".join(terms)


def highlights(marked: str) -> tuple[str, list[list[int]]]:
    """(plain snippet, [[start, end], ...] character offsets of the matches) from a marked snippet."""
    out, spans, start = [], [], None
    for ch in marked:
        if ch == _OPEN:
            start = len(out)
        elif ch == _CLOSE:
            if start is not None:
                spans.append([start, len(out)])
            start = None
        else:
            out.append(ch)
    return "".join(out), spans


def search(db, client_id: str, text: str, limit: int = MAX_RESULTS) -> list[dict]:
    """This client's messages matching ``text``, best first; never another client's."""
    query = match_query(text)
    if not client_id or query is None:
        return []
    rows = db.execute(
        f"""SELECT m.conversation_id, c.title, m.id AS message_id, m.role,
               snippet(messages_fts, 0, '{_OPEN}', '{_CLOSE}', '…', {SNIPPET_TOKENS}) AS marked
        FROM messages_fts JOIN messages m ON m.seq = messages_fts.rowid
        JOIN conversations c ON c.id = m.conversation_id
        WHERE messages_fts MATCH ? AND c.client_id = ?
        ORDER BY bm25(messages_fts), m.seq DESC LIMIT ?""", (query, client_id, limit)).fetchall()
    results = []
    for row in rows:
        snippet, spans = highlights(row["marked"])
        results.append({"conversation_id": row["conversation_id"], "title": row["title"],
                        "message_id": row["message_id"], "role": row["role"],
                        "snippet": snippet, "highlights": spans})
    return results
