"""The schema as an append-only list of migrations, and the code that applies them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Union

from . import cjk
from .backend import Executor
from .search import INDEXED_CHARS


def index_cjk(db: Executor, seq: int, status: str, text: str) -> None:
    """Put message ``seq`` into the CJK bigram index as it is now (finished text only)."""
    db.execute("DELETE FROM messages_cjk WHERE rowid = ?", (seq,))
    grams = cjk.grams(text[:INDEXED_CHARS]) if status != "streaming" else ""
    if grams:
        db.execute("INSERT INTO messages_cjk (rowid, grams) VALUES (?, ?)", (seq, grams))


def _index_cjk_of_every_message(db: Executor) -> None:
    """The CJK index of what is already stored (a message without CJK text costs one regex scan)."""
    rows = db.execute(f"SELECT seq, status, substr(content, 1, {INDEXED_CHARS}) AS text FROM messages"
                      " WHERE status != 'streaming'")
    for seq, status, text in rows.fetchall():
        if text and cjk.has_cjk(text):
            index_cjk(db, seq, status, text)


# A step of a migration: SQL, or a function of the connection for what SQL cannot do.
Step = Union[str, Callable[[Executor], None]]

# Each entry moves the schema from version N to N + 1; append, never edit.
MIGRATIONS: list[tuple[Step, ...]] = [
    (
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            title TEXT NOT NULL,
            title_set INTEGER NOT NULL DEFAULT 0,
            system TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        "CREATE INDEX conversations_by_client ON conversations (client_id, updated_at)",
        """CREATE TABLE messages (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL,
            reason TEXT,
            usage TEXT,
            timings TEXT,
            owner TEXT,
            created_at REAL NOT NULL)""",
        "CREATE INDEX messages_by_conversation ON messages (conversation_id, seq)",
        "CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming'",
    ),
    (
        # Versions: messages form a tree; the conversation remembers the leaf of its active path.
        "ALTER TABLE messages ADD COLUMN parent_id TEXT",
        "ALTER TABLE messages ADD COLUMN attachments TEXT",
        "ALTER TABLE conversations ADD COLUMN active_id TEXT",
        # Every stored conversation becomes a single path: each message's parent is the one before it.
        """UPDATE messages SET parent_id = (
            SELECT p.id FROM messages p WHERE p.conversation_id = messages.conversation_id
            AND p.seq < messages.seq ORDER BY p.seq DESC LIMIT 1)""",
        """UPDATE conversations SET active_id = (
            SELECT m.id FROM messages m WHERE m.conversation_id = conversations.id ORDER BY m.seq DESC LIMIT 1)""",
        "CREATE INDEX messages_by_parent ON messages (parent_id)",
        # Search: a full-text index of finished text, kept in step by triggers. Streaming
        # checkpoints are skipped so a long answer is indexed once, not once per checkpoint.
        "CREATE VIRTUAL TABLE messages_fts USING fts5(content, tokenize = 'unicode61 remove_diacritics 2')",
        "INSERT INTO messages_fts (rowid, content) SELECT seq, content FROM messages WHERE status != 'streaming'",
        """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages WHEN new.status != 'streaming' BEGIN
            INSERT INTO messages_fts (rowid, content) VALUES (new.seq, new.content); END""",
        """CREATE TRIGGER messages_fts_update AFTER UPDATE OF content, status ON messages
            WHEN new.status != 'streaming' BEGIN
            DELETE FROM messages_fts WHERE rowid = old.seq;
            INSERT INTO messages_fts (rowid, content) VALUES (new.seq, new.content); END""",
        """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            DELETE FROM messages_fts WHERE rowid = old.seq; END""",
    ),
    (
        # Per-conversation settings: pinned in the sidebar, the sampling parameters and the model its
        # turns use, and whether the user named it (then an edited first message keeps the title).
        "ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE conversations ADD COLUMN params TEXT",
        "ALTER TABLE conversations ADD COLUMN model TEXT",
        "ALTER TABLE conversations ADD COLUMN renamed INTEGER NOT NULL DEFAULT 0",
        # Which titles a user chose is not recorded before this: a title that is not its first
        # message (whole, or cut at "…") counts as chosen, so an edit never overwrites a user's.
        """UPDATE conversations SET renamed = 1 WHERE title_set = 1 AND NOT EXISTS (
            SELECT 1 FROM messages m WHERE m.conversation_id = conversations.id AND m.parent_id IS NULL
            AND m.role = 'user' AND (m.content = conversations.title OR (conversations.title LIKE '%…'
            AND instr(m.content, substr(conversations.title, 1, length(conversations.title) - 1)) = 1)))""",
    ),
    (
        # Search, bounded and in every language: the word index holds the first INDEXED_CHARS of each
        # message (one huge message then costs no more to index or search than a long one; what is
        # already indexed stays), and Chinese, Japanese and Korean runs get an index of their bigrams
        # (cjk.py), which the store keeps (index_cjk) because the bigrams are cut in Python.
        "DROP TRIGGER messages_fts_insert",
        "DROP TRIGGER messages_fts_update",
        f"""CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages WHEN new.status != 'streaming' BEGIN
            INSERT INTO messages_fts (rowid, content) VALUES (new.seq, substr(new.content, 1, {INDEXED_CHARS}));
            END""",
        f"""CREATE TRIGGER messages_fts_update AFTER UPDATE OF content, status ON messages
            WHEN new.status != 'streaming' BEGIN
            DELETE FROM messages_fts WHERE rowid = old.seq;
            INSERT INTO messages_fts (rowid, content) VALUES (new.seq, substr(new.content, 1, {INDEXED_CHARS}));
            END""",
        "CREATE VIRTUAL TABLE messages_cjk USING fts5(grams, tokenize = 'unicode61')",
        """CREATE TRIGGER messages_cjk_delete AFTER DELETE ON messages BEGIN
            DELETE FROM messages_cjk WHERE rowid = old.seq; END""",
        _index_cjk_of_every_message,
    ),
    (
        # Storage per address: the address a conversation was started from (its client's, as the
        # limits count it) and the characters it holds, so fresh cookies share one quota.
        "ALTER TABLE conversations ADD COLUMN address TEXT",
        "ALTER TABLE conversations ADD COLUMN size INTEGER NOT NULL DEFAULT 0",
        """UPDATE conversations SET size = length(coalesce(system, '')) + (SELECT coalesce(sum(length(content)
            + length(coalesce(attachments, ''))), 0) FROM messages WHERE conversation_id = conversations.id)""",
        "CREATE INDEX conversations_by_address ON conversations (address) WHERE address IS NOT NULL",
    ),
    (
        # A read-only link (CHAT_SHARING): the conversation's secret token, or NULL when not shared.
        "ALTER TABLE conversations ADD COLUMN share_token TEXT",
        "CREATE UNIQUE INDEX conversations_by_share_token ON conversations (share_token) WHERE share_token IS NOT NULL",
    ),
    (
        # Presets: a client's named sets of system prompt and sampling parameters.
        """CREATE TABLE presets (
            id TEXT PRIMARY KEY,
            client_id TEXT NOT NULL,
            name TEXT NOT NULL,
            system TEXT,
            params TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        "CREATE UNIQUE INDEX presets_by_client ON presets (client_id, name)",
    ),
    (
        # Archive and trash: an archived conversation leaves the main list but stays whole; a deleted
        # one waits in the trash (deleted_at) until CHAT_TRASH_DAYS have passed, restorable meanwhile.
        "ALTER TABLE conversations ADD COLUMN archived INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE conversations ADD COLUMN deleted_at REAL",
        "CREATE INDEX conversations_in_trash ON conversations (deleted_at) WHERE deleted_at IS NOT NULL",
    ),
    (
        # A thinking model's thinking, kept apart from its answer (NULL: none).
        "ALTER TABLE messages ADD COLUMN reasoning TEXT",
    ),
]


def migrate(db: Executor) -> None:
    """Apply the migrations the file has not seen; the caller holds a write transaction. A step is
    SQL, or a function of the connection for what SQL cannot do."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    for number, statements in enumerate(MIGRATIONS[version:], start=version + 1):
        for statement in statements:
            if callable(statement):
                statement(db)
            else:
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {number}")

