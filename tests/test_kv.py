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


def test_a_windowed_layers_row_keeps_its_window_and_goes_back_right_aligned():
    """``keep``: a row taken out holds a windowed layer's last columns only (the window and TRIM_SLACK more); added
    back, they land at its end with zeros before them (finite, never in a later column's window), the other
    layers whole; ``cut`` gives a prefix of it only near its end."""
    kept = kv_module.windows_kept([4, 0, 4])
    assert kept == (4 - 1 + kv_module.TRIM_SLACK, 0, kept[0])
    buf = KVBuffer(3, 2, 4, torch.float32, "cpu", rows=1, capacity=8, keep=kept)
    total = kept[0] + 30
    keys = [torch.arange(total, dtype=torch.float32).view(1, 1, total, 1).expand(1, 2, total, 4).clone()
            for _ in range(3)]
    buf.add_row(keys, [k.clone() for k in keys])
    out_keys, out_values = buf.row(0)
    assert [k.shape[2] for k in out_keys] == [kept[0], total, kept[0]] == [v.shape[2] for v in out_values]
    assert torch.equal(out_keys[0], keys[0][:, :, -kept[0]:]) and torch.equal(out_keys[1], keys[1])
    again = KVBuffer(3, 2, 4, torch.float32, "cpu", rows=1, capacity=8, keep=kept)
    again.add_row(out_keys, out_values)
    assert again.length - again.start == total
    back = again.keys[0][0, :, again.start:again.length]
    assert torch.equal(back[:, -kept[0]:], keys[0][0, :, -kept[0]:]) and not back[:, :30].any()
    assert torch.equal(again.keys[1][0, :, again.start:again.length], keys[1][0])
    assert kv_module.cut(out_keys[0], total, total - kv_module.TRIM_SLACK).shape[2] == 3
    assert kv_module.cut(out_keys[0], total, total - kv_module.TRIM_SLACK - 1) is None
    assert kv_module.cut(out_keys[1], total, 10).shape[2] == 10
