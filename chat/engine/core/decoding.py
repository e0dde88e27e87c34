"""Token ids → text, incrementally, plus stop-sequence matching (no torch here)."""
from __future__ import annotations

from typing import Any


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that a later token never rewrites.

    Decodes a small window (from the last emitted boundary), so each token costs
    O(1); holds text back while it ends in an incomplete multi-byte character.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of the answer; the bytes of a character that an
        answer cut short (length) left incomplete are dropped, not shown as U+FFFD."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):].rstrip("\ufffd") if after.startswith(before) else ""


class StopMatcher:
    """Holds back text that may be the start of a stop sequence; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop sequence was hit)."""
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.buf)), hold, -1):
                if stop.startswith(self.buf[-k:]):
                    hold = k
                    break
        out = self.buf[:len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        """Text held back when the answer ends without a match."""
        out, self.buf = self.buf, ""
        return out
