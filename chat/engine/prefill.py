"""Prompts being prefilled, a chunk at a time, in their own buffer until they join the batch."""
from __future__ import annotations

import torch

from .kv import KVBuffer


class PrefillJob:
    """Prompts prefilled together (left-padded, one forward per chunk), or one continuing reused KV.

    ``dims`` is (layers, heads, head dim, dtype, device); ``reused`` is (keys, values, n)
    from the prefix cache for a single prompt whose first ``n`` tokens are already done.
    """

    def __init__(self, prompts: list, dims, reused=None):
        layers, heads, dim, dtype, device = dims
        self.slots: list = []  # the engine's rows-to-be, in prompt order
        self.fresh = reused is None
        width = max(len(ids) for ids in prompts)
        self.kv = KVBuffer(layers, heads, dim, dtype, device, rows=len(prompts), capacity=width + 64)
        if reused is not None:
            keys, values, start = reused
            self.kv.add_row(keys, values)
            ids = prompts[0]
            self.tokens = torch.tensor([ids[start:]], device=device)
            self.positions = torch.arange(start, len(ids), device=device)[None, :]
            self.pads = [0]
        else:
            self.kv.n = len(prompts)
            self.tokens = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
            self.positions = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
            self.pads = [width - len(ids) for ids in prompts]
            for r, (ids, pad) in enumerate(zip(prompts, self.pads)):
                self.tokens[r, pad:] = torch.tensor(ids, device=device)
                self.positions[r, pad:] = torch.arange(len(ids), device=device)
        self.real = (torch.arange(self.tokens.shape[1], device=device)[None, :]
                     >= torch.tensor(self.pads, device=device)[:, None]).long()
        self.done = 0

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def remaining(self) -> int:
        return self.tokens.shape[1] - self.done

    def step(self, forward, columns: int):
        """Prefill the next ``columns`` prompt positions; the last position's logits once finished, else None."""
        kv, begin = self.kv, self.done
        end = min(begin + columns, self.tokens.shape[1])
        q = end - begin
        kv.reserve(q)
        kv.mask[:kv.n, kv.length:kv.length + q] = self.real[:, begin:end]
        logits = forward(self.tokens[:, begin:end], kv, self.positions[:, begin:end])
        for r, pad in enumerate(self.pads):
            if pad > begin:  # padding attends to nothing; keep its never-read KV finite
                for t in kv.keys + kv.values:
                    t[r, :, kv.length:kv.length + min(pad, end) - begin] = 0
        kv.length += q
        self.done = end
        return logits if self.done == self.tokens.shape[1] else None


class ChunkBudget:
    """Prompt tokens to prefill between two decode steps: at most ``cap``, fewer where a chunk would stall.

    Prefill is compute-bound and decoding memory-bound, so how many prompt tokens
    fit in the time of a decode step differs between machines and with load. The
    budget follows what is measured, so a chunk costs about ``stall`` decode steps.
    """

    def __init__(self, cap: int, stall: float = 2.0, floor: int = 16):
        self.cap, self.stall, self.floor = cap, stall, min(floor, cap)
        self.tokens = float(cap)
        self.step_s = None

    def budget(self) -> int:
        return int(self.tokens)

    def decoded(self, seconds: float) -> None:
        """A decode step took ``seconds``."""
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` prompt tokens took ``seconds`` while others were decoding."""
        if self.step_s is None or seconds <= 0 or tokens < self.tokens / 2:
            return  # a short tail chunk says little about what a full one costs
        change = min(2.0, max(0.5, self.stall * self.step_s / seconds))
        self.tokens = min(self.cap, max(self.floor, self.tokens * change))
