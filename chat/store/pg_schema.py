"""The PostgreSQL schema as its own append-only list of migrations, applied under an advisory lock."""
from __future__ import annotations

from .backend import Connection
from .cjk import RUN
from .search import INDEXED_CHARS

# cjk.RUN's character class in PostgreSQL's regular expressions (\uXXXX and \UXXXXXXXX escapes).
CJK_CLASS = "".join(c if c in "[]-" else (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
                    for c in RUN.pattern.rstrip("+"))

# Any constant will do: every process migrating the same database takes this one lock.
MIGRATION_LOCK = 0x63686174  # "chat"

# The logical schema of schema.py (SQLite) in one step: there were no PostgreSQL stores before
# it. Each entry moves the schema from version N to N + 1; append, never edit.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        # rowid: creation order, the tie-break of the listing (SQLite's implicit rowid).
        """CREATE TABLE conversations (
            rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            title TEXT NOT NULL,
            title_set INTEGER NOT NULL DEFAULT 0,
            system TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            active_id TEXT)""",
        "CREATE INDEX conversations_by_client ON conversations (client_id, updated_at)",
        """CREATE TABLE messages (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            parent_id TEXT,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            attachments TEXT,
            status TEXT NOT NULL,
            reason TEXT,
            usage TEXT,
            timings TEXT,
            owner TEXT,
            created_at DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX messages_by_conversation ON messages (conversation_id, seq)",
        "CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming'",
        "CREATE INDEX messages_by_parent ON messages (parent_id)",
        # Search (search.py): finished text only, so streaming checkpoints never touch the index.
        """CREATE INDEX messages_search ON messages USING GIN (to_tsvector('simple', content))
            WHERE status <> 'streaming'""",
    ),
    (
        # Per-conversation settings (schema.py's third migration).
        "ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE conversations ADD COLUMN params TEXT",
        "ALTER TABLE conversations ADD COLUMN model TEXT",
        "ALTER TABLE conversations ADD COLUMN renamed INTEGER NOT NULL DEFAULT 0",
        """UPDATE conversations SET renamed = 1 WHERE title_set = 1 AND NOT EXISTS (
            SELECT 1 FROM messages m WHERE m.conversation_id = conversations.id AND m.parent_id IS NULL
            AND m.role = 'user' AND (m.content = conversations.title OR (conversations.title LIKE '%…'
            AND strpos(m.content, left(conversations.title, -1)) = 1)))""",
    ),
    (
        # Search, bounded and in every language (schema.py's fourth migration): the word index holds
        # the first INDEXED_CHARS of each message (to_tsvector also refuses text of more than 1 MB),
        # and Chinese, Japanese and Korean runs get an index of their bigrams (cjk.py), here
        # computed by a function of the database. The expressions are search.py's TSV_*.
        "DROP INDEX messages_search",
        f"""CREATE INDEX messages_search ON messages
            USING GIN (to_tsvector('simple', substr(content, 1, {INDEXED_CHARS}))) WHERE status <> 'streaming'""",
        f"""CREATE FUNCTION chat_cjk_grams(t text) RETURNS tsvector LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
            AS $$
            SELECT coalesce(array_to_tsvector(array_agg(DISTINCT substr(runs.run, i, 2))), ''::tsvector)
            FROM (SELECT (regexp_matches(t, '{CJK_CLASS}+', 'g'))[1] AS run) runs,
                 generate_series(1, char_length(runs.run)) AS i
            $$""",
        f"""CREATE INDEX messages_search_cjk ON messages
            USING GIN (chat_cjk_grams(substr(content, 1, {INDEXED_CHARS}))) WHERE status <> 'streaming'""",
    ),
    (
        # Storage per address (schema.py's fifth migration).
        "ALTER TABLE conversations ADD COLUMN address TEXT",
        "ALTER TABLE conversations ADD COLUMN size BIGINT NOT NULL DEFAULT 0",
        """UPDATE conversations SET size = length(coalesce(system, '')) + (SELECT coalesce(sum(length(content)
            + length(coalesce(attachments, ''))), 0) FROM messages WHERE conversation_id = conversations.id)""",
        "CREATE INDEX conversations_by_address ON conversations (address) WHERE address IS NOT NULL",
    ),
    (
        # A read-only link (schema.py's sixth migration).
        "ALTER TABLE conversations ADD COLUMN share_token TEXT",
        "CREATE UNIQUE INDEX conversations_by_share_token ON conversations (share_token) WHERE share_token IS NOT NULL",
    ),
    (
        # Presets (schema.py's seventh migration).
        """CREATE TABLE presets (
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            name TEXT NOT NULL,
            system TEXT,
            params TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE UNIQUE INDEX presets_by_client ON presets (client_id, name)",
    ),
    (
        # Archive and trash (schema.py's eighth migration).
        "ALTER TABLE conversations ADD COLUMN archived INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE conversations ADD COLUMN deleted_at DOUBLE PRECISION",
        "CREATE INDEX conversations_in_trash ON conversations (deleted_at) WHERE deleted_at IS NOT NULL",
    ),
    (
        # A thinking model's thinking (schema.py's ninth migration).
        "ALTER TABLE messages ADD COLUMN reasoning TEXT",
    ),
]


def migrate(db: Connection) -> None:
    """Apply the migrations the database has not seen, in one transaction. The advisory lock
    makes processes starting together take turns: the first migrates, the others find it done."""
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        if row is None:
            db.execute("INSERT INTO schema_version (version) VALUES (0)")
        version = row["version"] if row is not None else 0
        for number, statements in enumerate(MIGRATIONS[version:], start=version + 1):
            for statement in statements:
                db.execute(statement)
            db.execute("UPDATE schema_version SET version = %s", (number,))


def version(db: Connection) -> int:
    """The schema version stored in the database."""
    row = db.execute("SELECT version FROM schema_version").fetchone()
    return row["version"] if row is not None else 0
