"""A new conversation's title, written by the model after its first answer (CHAT_TITLES).

Off the answer's path: the answer's ``done`` has gone out and its conversation is free before the
title is asked for; the title is a short, greedy, bounded generation of its own, in the background (the
engine starts it only while no answer decodes or waits), and a user's own title (a rename meanwhile)
always wins.
"""
from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Callable

from .engine import GenParams
from .engine.events import Delta, Done, Refused
from .errors import ChatError

if TYPE_CHECKING:
    from .engine import Engine
    from .store import Store

log = logging.getLogger(__name__)

TITLE_TOKENS = 20  # a title's generation: at most this many tokens
TITLE_TIMEOUT_S = 15.0  # and this long, queue included
TITLE_CHARS = 60  # the stored title's length, at most (the store's first-words titles are as long)
SHOWN_CHARS = 600  # of the question and of the answer, what the model reads
INSTRUCTION = ("Write a short title (2 to 6 words) for the conversation below. Write it in the language the "
               "user wrote in. Reply with the title only: no quotes, no period, no explanation.")


SCRIPTS = (  # (first, last code point, the language a small model should be told to write in)
    (0x3040, 0x30FF, "Japanese"), (0xAC00, 0xD7AF, "Korean"), (0x4E00, 0x9FFF, "Chinese"),
    (0x0400, 0x04FF, "the user's language (Cyrillic script)"), (0x0600, 0x06FF, "the user's language (Arabic script)"),
    (0x0900, 0x097F, "the user's language (Devanagari script)"), (0x0E00, 0x0E7F, "Thai"),
)


def language_of(question: str) -> str | None:
    """The language a question's script says plainly (Japanese kana before Chinese characters), or None."""
    for low, high, language in SCRIPTS:
        if sum(low <= ord(ch) <= high for ch in question[:SHOWN_CHARS]) >= 2:
            return language
    return None


def prompt(question: str, answer: str) -> list[dict]:
    """The messages that ask the model for a title of this first exchange (in the question's language,
    named outright where its script says it: small models otherwise drift to English)."""
    text = f"User: {question[:SHOWN_CHARS]}\n\nAssistant: {answer[:SHOWN_CHARS]}"
    language = language_of(question)
    instruction = INSTRUCTION + (f" The title must be in {language}." if language else "")
    return [{"role": "system", "content": instruction}, {"role": "user", "content": text}]


_LEAD = re.compile(r"^[*_#\s]*(?:title|titre|titel|título|标题|題名|タイトル)[*_\s]*[:：][*_\s]*", re.IGNORECASE)
_QUOTES = "\"'“”‘’«»「」『』*`#"


def clean(text: str) -> str | None:
    """The title in what the model wrote: its first non-empty line, without a "Title:" lead, quotes,
    Markdown marks or a final period, cut at a word within TITLE_CHARS; None when nothing is left."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = _LEAD.sub("", line).strip().strip(_QUOTES).strip()
    line = line.rstrip(".。!！ ").strip(_QUOTES).strip()
    line = " ".join(line.split())
    if not line or not any(ch.isalnum() for ch in line):
        return None
    if len(line) > TITLE_CHARS:
        cut = line[:TITLE_CHARS - 1]
        space = cut.rfind(" ")
        line = (cut[:space] if space >= TITLE_CHARS // 2 else cut).rstrip() + "…"
    return line


class Titler:
    """Writes a new conversation's title with the model, within TITLE_TOKENS and TITLE_TIMEOUT_S."""

    def __init__(self, engine: Engine, store: Store, timeout_s: float = TITLE_TIMEOUT_S) -> None:
        self.engine, self.store, self.timeout_s = engine, store, timeout_s

    def generate(self, question: str, answer: str, model: str | None, owner: str) -> str | None:
        """The model's title for this exchange, or None (refused, failed, too slow, nothing usable)."""
        # In the background: it starts only while no answer decodes or waits, so it never slows one (on a
        # server busy past TITLE_TIMEOUT_S the first words stay the title); a thinking model answers a title at
        # once: its few tokens are not spent thinking.
        params = GenParams(temperature=0.0, max_new_tokens=TITLE_TOKENS, model=model, background=True,
                           enable_thinking=False)
        try:
            gen = self.engine.submit(prompt(question, answer), params, owner=owner)
        except ChatError as exc:  # the queue is full, or the server stops: the first words stay
            log.info("no title written: %s", exc.message)
            return None
        deadline = time.monotonic() + self.timeout_s
        pieces: list[str] = []
        ended = None
        for event in gen.events(keepalive=0.5):
            if isinstance(event, Delta):
                pieces.append(event.text)
            elif isinstance(event, (Done, Refused)):
                ended = event
            if time.monotonic() > deadline:
                gen.cancel("timeout")
        if not isinstance(ended, Done) or ended.reason not in ("stop", "length"):
            return None
        return clean("".join(pieces))

    def write(self, conversation_id: str, question: str, answer: str, model: str | None, owner: str,
              tell: Callable[[str], object]) -> None:
        """Title the conversation unless its user has named it meanwhile; ``tell(title)`` once stored."""
        try:
            title = self.generate(question, answer, model, owner)
            if title and self.store.set_title(conversation_id, title):
                tell(title)
        except Exception:  # a title is a nicety: the conversation keeps its first words
            log.exception("writing the title of %s failed", conversation_id)
