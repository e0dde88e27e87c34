"""Full-text search over one client's messages, plain snippets with offsets: SQLite FTS5, or
PostgreSQL's tsvector with the 'simple' configuration (no stemming, no stop words)."""
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


def ts_query(text: str) -> str | None:
    """The same query for PostgreSQL's to_tsquery: quoted words (only word characters, so
    tsquery syntax stays inert) joined by &, the last one a prefix."""
    words = _WORD.findall(text or "")[:16]
    return " & ".join(f"'{w}'" for w in words) + ":*" if words else None


def highlights(marked: str) -> tuple[str, list[list[int]]]:
    """(plain snippet, [[start, end], ...] character offsets of the matches) from a marked snippet."""
    out: list[str]
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


_COLUMNS = "m.conversation_id, c.title, m.id AS message_id, m.role"

# SQLite: the FTS5 table's rowid is the message's seq.
FTS5 = f"""SELECT {_COLUMNS}, snippet(messages_fts, 0, '{_OPEN}', '{_CLOSE}', '…', {SNIPPET_TOKENS}) AS marked
    FROM messages_fts JOIN messages m ON m.seq = messages_fts.rowid
    JOIN conversations c ON c.id = m.conversation_id
    WHERE messages_fts MATCH ? AND c.client_id = ?
    ORDER BY bm25(messages_fts), m.seq DESC LIMIT ?"""

# PostgreSQL: _TSV is the expression of the GIN index messages_search (see pg_schema.py); the
# planner uses the index only for this very expression and the index's status <> 'streaming'.
_TSV = "to_tsvector('simple', m.content)"
_HEADLINE = (f"StartSel={_OPEN}, StopSel={_CLOSE}, MaxWords={SNIPPET_TOKENS}, "
             f"MinWords={SNIPPET_TOKENS // 2}, ShortWord=0")
TSVECTOR = f"""SELECT {_COLUMNS}, ts_headline('simple', m.content, q, '{_HEADLINE}') AS marked
    FROM messages m JOIN conversations c ON c.id = m.conversation_id, to_tsquery('simple', ?) AS q
    WHERE {_TSV} @@ q AND m.status <> 'streaming' AND c.client_id = ?
    ORDER BY ts_rank({_TSV}, q) DESC, m.seq DESC LIMIT ?"""


def search(db, sql: str, query: str | None, client_id: str, limit: int = MAX_RESULTS) -> list[dict]:
    """This client's messages matching ``query`` (match_query's for FTS5, ts_query's for
    TSVECTOR), best first, with plain snippets and highlight offsets; never another client's."""
    if not client_id or query is None:
        return []
    results = []
    for row in db.execute(sql, (query, client_id, limit)).fetchall():
        snippet, spans = highlights(row["marked"])
        results.append({"conversation_id": row["conversation_id"], "title": row["title"],
                        "message_id": row["message_id"], "role": row["role"],
                        "snippet": snippet, "highlights": spans})
    return results
