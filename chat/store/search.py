"""Full-text search over one client's messages: what a query means, the SQL of each backend, and
the results with plain snippets and highlight offsets.

Words are matched by the backends' word indexes (SQLite FTS5 with unicode61, PostgreSQL's tsvector
with the 'simple' configuration: no stemming, no stop words); Chinese, Japanese and Korean runs by
an index of their bigrams (see cjk.py). Both indexes hold the first INDEXED_CHARS of each message,
so one huge message costs the index, and a search, no more than a long one. The backends run the
query under a time budget and this module cuts the snippets (see snippets.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import cjk, snippets
from .backend import Executor

MAX_RESULTS = 50
MAX_WORDS = 16
INDEXED_CHARS = 65536  # of each message, what the indexes hold and snippets are cut from
_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"[^\W_]+")


@dataclass
class Query:
    """A parsed query: every word and every CJK run must match, the last word as a prefix."""

    words: list[str] = field(default_factory=list)  # whole words (the last one too, unless ``prefix``)
    prefix: str | None = None  # the last word, being typed
    runs: list[str] = field(default_factory=list)  # CJK runs

    def fts5_words(self) -> str | None:
        """The FTS5 query on the word index (quoted: FTS5 syntax in the words stays inert)."""
        terms = [f'"{w}"' for w in self.words] + ([f'"{self.prefix}"*'] if self.prefix else [])
        return " ".join(terms) or None

    def fts5_cjk(self) -> str | None:
        """The FTS5 query on the bigram index: each run the phrase of its bigrams (one character: a prefix)."""
        terms = [f'"{" ".join(cjk.run_grams(r)[:-1])}"' if len(r) > 1 else f'"{r}"*' for r in self.runs]
        return " ".join(terms) or None

    def ts_words(self) -> str | None:
        """The word part for PostgreSQL's to_tsquery: quoted words joined by &, the prefix last."""
        terms = [f"'{w}'" for w in self.words] + ([f"'{self.prefix}':*"] if self.prefix else [])
        return " & ".join(terms) or None

    def ts_cjk(self) -> str | None:
        """The bigram part as a tsquery (every bigram of every run; the exact run is checked apart)."""
        terms = [f"'{g}'" for r in self.runs for g in cjk.run_grams(r)[:-1]] + \
                [f"'{r}':*" for r in self.runs if len(r) == 1]
        return " & ".join(dict.fromkeys(terms)) or None

    def marks(self) -> re.Pattern | None:
        """What snippets mark."""
        words = [t for w in self.words for t in _TOKEN.findall(w)]
        tokens = _TOKEN.findall(self.prefix or "")
        words += tokens[:-1]
        return snippets.pattern(words, tokens[-1] if tokens else None, self.runs)


def parse(text: str) -> Query | None:
    """What a person typed, as a Query: the words (at most MAX_WORDS), each cut into its CJK runs
    and the rest; None when there is nothing to look for."""
    query = Query()
    pieces = [(is_cjk, part) for word in _WORD.findall(text or "")[:MAX_WORDS]
              for is_cjk, part in cjk.split(word) if is_cjk or _TOKEN.search(part)]
    for i, (is_cjk, part) in enumerate(pieces):
        if is_cjk:
            query.runs.append(part)
        elif i == len(pieces) - 1:
            query.prefix = part
        else:
            query.words.append(part)
    return query if query.words or query.prefix or query.runs else None


@dataclass
class Ranked:
    """A backend's query for the best matches: its SQL, the arguments before ``client_id`` and those
    between it and the limit, and its dialect's parameter mark."""

    sql: str
    before: list
    after: list = field(default_factory=list)
    mark: str = field(kw_only=True)


# ---- SQLite: the FTS5 tables' rowid is the message's seq; bm25 is lower for better matches.

def sqlite_ranked(query: Query) -> Ranked:
    """The best matches (seq and the result's fields) on SQLite."""
    hits = []
    if query.fts5_words():
        hits.append(("SELECT rowid AS seq, bm25(messages_fts) AS score FROM messages_fts"
                     " WHERE messages_fts MATCH ?", query.fts5_words()))
    if query.fts5_cjk():
        hits.append(("SELECT rowid AS seq, bm25(messages_cjk) AS score FROM messages_cjk"
                     " WHERE messages_cjk MATCH ?", query.fts5_cjk()))
    if len(hits) == 1:
        source, args = hits[0][0], [hits[0][1]]
    else:
        source = (f"SELECT a.seq, a.score + b.score AS score FROM ({hits[0][0]}) a"
                  f" JOIN ({hits[1][0]}) b ON b.seq = a.seq")
        args = [hits[0][1], hits[1][1]]
    return Ranked(f"""SELECT m.seq, m.conversation_id, c.title, m.id AS message_id, m.role, m.created_at
        FROM ({source}) h JOIN messages m ON m.seq = h.seq JOIN conversations c ON c.id = m.conversation_id
        WHERE c.client_id = ? AND c.deleted_at IS NULL ORDER BY h.score, m.seq DESC LIMIT ?""", args, mark="?")


# ---- PostgreSQL: the expressions are those of the GIN indexes in pg_schema.py (the planner uses
# an index only for its very expression, and the index's status <> 'streaming').

TSV_WORDS = f"to_tsvector('simple', substr(m.content, 1, {INDEXED_CHARS}))"
TSV_CJK = f"chat_cjk_grams(substr(m.content, 1, {INDEXED_CHARS}))"


def pg_ranked(query: Query) -> Ranked:
    """The best matches, as sqlite_ranked, on PostgreSQL."""
    where, ranks, args = [], [], []
    if query.ts_words():
        where.append(f"{TSV_WORDS} @@ to_tsquery('simple', %s)")
        ranks.append(f"ts_rank({TSV_WORDS}, to_tsquery('simple', %s))")
        args.append(query.ts_words())
    if query.ts_cjk():
        # The bigram index finds candidates; the runs themselves must occur (bigrams have no order).
        where.append(f"{TSV_CJK} @@ %s::tsquery")
        ranks.append(f"ts_rank({TSV_CJK}, %s::tsquery)")
        args.append(query.ts_cjk())
        where += [f"strpos(substr(m.content, 1, {INDEXED_CHARS}), %s) > 0"] * len(query.runs)
    where_args = args + (list(query.runs) if query.ts_cjk() else [])
    sql = f"""SELECT m.seq, m.conversation_id, c.title, m.id AS message_id, m.role, m.created_at
        FROM messages m JOIN conversations c ON c.id = m.conversation_id
        WHERE {' AND '.join(where)} AND m.status <> 'streaming' AND c.deleted_at IS NULL AND c.client_id = %s
        ORDER BY {' + '.join(ranks)} DESC, m.seq DESC LIMIT %s"""
    return Ranked(sql, where_args, args, mark="%s")


def search(db: Executor, ranked: Ranked, query: Query, client_id: str, limit: int = MAX_RESULTS) -> list[dict]:
    """The best ``limit`` of this client's messages for ``query`` (``ranked``: the backend's SQL),
    best first, each with a snippet of its indexed text and the offsets of its matches."""
    rows = db.execute(ranked.sql, (*ranked.before, client_id, *ranked.after, limit)).fetchall()
    if not rows:
        return []
    seqs = [row["seq"] for row in rows]
    texts = {r["seq"]: r["text"] for r in db.execute(
        f"SELECT seq, substr(content, 1, {ranked.mark}) AS text FROM messages"
        f" WHERE seq IN ({', '.join([ranked.mark] * len(seqs))})",
        (INDEXED_CHARS, *seqs)).fetchall()}
    marks = query.marks()
    results = []
    for row in rows:
        text, spans = snippets.snippet(texts.get(row["seq"], ""), marks)
        results.append({"conversation_id": row["conversation_id"], "title": row["title"],
                        "message_id": row["message_id"], "role": row["role"], "created_at": row["created_at"],
                        "snippet": text, "highlights": spans})
    return results

