"""One request's state in the engine: its prompt, sampler, decoder and when it must end."""
from __future__ import annotations

import random
import time
from typing import Any

import torch

from ...config import Settings
from ..base import Generation
from ..events import Delta, Done
from .budget import Guard
from .decoding import IncrementalDecoder, StopMatcher
from .grammar import failure_message
from .prompt import splitter


class Slot:
    """One request being prefilled or decoded."""

    def __init__(self, gen: Generation, ids: list[int], tokenizer: Any, settings: Settings,
                 stops: tuple[str, ...] = ()) -> None:
        self.gen = gen
        self.settings = settings
        self.params = gen.params
        self.prompt_ids = ids
        self.out_ids: list[int] = []
        self.pos = len(ids)  # position id of the next token fed to the model
        self.last = -1  # last sampled token, fed at the next step (none before the first)
        self.decoder = IncrementalDecoder(tokenizer)
        # a raw prompt has no template, so none of its stop text
        self.stopper = StopMatcher(self.params.stop + (() if self.params.raw_prompt else stops))
        self.generator = torch.Generator()
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.deadline = time.monotonic() + settings.generation_timeout_s
        self.max_new = min(self.params.max_new_tokens, settings.max_new_tokens)
        self.context = settings.context_tokens
        self.first_delta_at: float | None = None
        self.reused = 0
        self.hit_stop = False
        self.matcher: Any = None  # the grammar's llguidance matcher, when the answer has one
        self.failure: str | None = None  # why the answer ended with ``error``
        self.guard: Guard | None = None  # its budget and runaway guards (budget.py)
        self.pending: list = []  # log probability entries of tokens whose text is not out yet
        self.drafts: Any = None  # drafts.Row, once the row runs alone with drafts on
        self.thinking = splitter(tokenizer, gen.messages, self.params)  # a thinking model's: thinking apart

    def constrain(self, matcher: Any, grammars: Any) -> None:
        """Follow a grammar (``matcher``: llguidance's, or None), with its budget and guards."""
        self.matcher = matcher
        if matcher is not None:
            room = min(self.max_new, self.context - self.pos - 1)
            self.guard = Guard(grammars.table, matcher, room, self.settings, calls=self.params.tool_mode is not None)

    def take(self, token: int, eos_ids: frozenset) -> tuple[str, str | None]:
        """(text this token completes, reason the answer ends or None)."""
        if self.matcher is not None:
            if not self.matcher.consume_token(token) and self.matcher.is_error():
                # never a clean stop on text the grammar did not accept: the answer ends with ``error``
                self.failure = failure_message(self.matcher)
                return "", "error"
            if self.guard is not None:
                self.guard.took(token)
        if token in eos_ids:
            return "", self._ended()
        self.out_ids.append(token)
        self.last = token
        text, hit = self.stopper.push(self.decoder.push(token))
        if hit:
            self.hit_stop = True
            return text, "stop"
        if self.matcher is not None and self.matcher.is_stopped():
            return text, self._ended()  # the grammar is complete and allows nothing more
        if len(self.out_ids) >= self.max_new or self.pos + 1 >= self.context:
            return text, "length"
        return text, None

    def _ended(self) -> str:
        """How a grammar's complete answer ended: ``length`` when its budget closed it."""
        return "length" if self.guard is not None and self.guard.closed else "stop"

    def flush(self) -> str:
        """Text still held back when the answer ends (nothing after a stop sequence)."""
        if self.hit_stop:
            return ""
        text, hit = self.stopper.push(self.decoder.flush())
        return text if hit else text + self.stopper.flush()

    def delta(self, text: str, last: bool = False) -> Delta | None:
        """A piece of text to emit (with the log probabilities of the tokens it covers), or None; ``last``:
        the answer's end, where entries of tokens that made no text go out too."""
        if self.first_delta_at is None and text:
            self.first_delta_at = time.monotonic()
        reasoning = ""
        if self.thinking is not None:  # a thinking model: its thinking apart from its answer
            reasoning, text = self.thinking.push(text)
            if last:
                more = self.thinking.flush()
                reasoning, text = reasoning + more[0], text + more[1]
        if not text and not reasoning and not (last and self.pending):
            return None
        entries = tuple(self.pending)
        self.pending.clear()
        return Delta(text, entries, tokens=len(self.out_ids), reasoning=reasoning)

    def done(self, reason: str, message: str | None = None) -> Done:
        """The answer's end: its usage and timings."""
        return Done.build(reason, len(self.prompt_ids), len(self.out_ids), self.gen.submitted_at, self.first_delta_at,
                          self.reused, message, message)
