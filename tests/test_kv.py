"""The batch KV buffer: what attention reads is always finite, even over uninitialized memory."""
from __future__ import annotations

import random

import torch

from chat.engine.kv import buffer as kv_module
from chat.engine.kv.buffer import KVBuffer


def row(length: int, value: float):
    """Per-layer (1, heads, length, dim) keys and values filled with ``value``."""
    make = lambda: [torch.full((1, 2, length, 4), value) for _ in range(3)]  # noqa: E731
    return make(), make()


def test_attended_columns_stay_finite_through_joins_leaves_and_growth(monkeypatch):
    # Fresh memory full of NaN: any column read before being written or zeroed would show.
    monkeypatch.setattr(kv_module.torch, "empty", lambda *a, **k: torch.full(*a, float("nan"), **k))
    rng = random.Random(0)
    buf = KVBuffer(3, 2, 4, torch.float32, "cpu", rows=1, capacity=8)
    for step in range(200):
        action = rng.random()
        if buf.n and action < 0.3:
            buf.remove_row(rng.randrange(buf.n))
        elif action < 0.6:
            buf.add_row(*row(rng.choice([1, 5, 40, 300]), float(step)))
        elif buf.n:  # a decode step: one new column for every row
            buf.reserve(1)
            buf.mask[:buf.n, buf.length] = 1
            for layer in range(3):
                buf.write(layer, torch.ones(buf.n, 2, 1, 4), torch.ones(buf.n, 2, 1, 4))
            buf.length += 1
        for t in buf.keys + buf.values:
            assert torch.isfinite(t[:buf.n, :, buf.start:buf.length]).all(), step
