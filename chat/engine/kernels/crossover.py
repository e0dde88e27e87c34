"""Where each product's int4 weights pay and where its dense copy does: the crossover (``quant.Linear``).

A ``Linear`` holding both int4 and dense weights (torch's int4 kernel on a CPU with native bf16) takes int4
for decode steps of up to ``crossover`` rows and dense above. The rows are measured per product shape,
while the engine is idle after start-up (a second or so a shape), and kept by the caller for later starts.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .quant import Linear


def _seconds(fn: Callable[[Linear, torch.Tensor], torch.Tensor], linears: list, x: torch.Tensor, reps: int) -> float:
    """Best of ``reps`` passes of ``fn`` over every Linear, each pass one product per Linear: the
    weights come from memory, as they do in a forward (one Linear alone stays in the cache)."""
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms the kernels up
        started = time.perf_counter()
        for linear in linears:
            fn(linear, x)
        best = min(best, time.perf_counter() - started)
    return best


def _dense_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    assert linear.dense is not None
    return F.linear(x, linear.dense)


def _quant_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    assert linear.quant is not None
    return linear.quant(x)


def crossover(linears: list[Linear], rows: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
              reps: int = 2) -> int:
    """The most rows at which the int4 products of ``linears`` (all of one shape, each with both
    weights) are still faster than the dense ones, measured; 0 when int4 never wins."""
    best = 0
    shape = linears[0].dense
    assert shape is not None
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, shape.shape[1], dtype=shape.dtype)
            dense = _seconds(_dense_product, linears, x, reps)
            int4 = _seconds(_quant_product, linears, x, reps)
            if int4 < dense:
                best = m
            elif m > 2 * max(best, 4):
                break  # dense has won at twice the rows int4 last won at: it only gets further ahead
    return best


def by_shape(linears: list[Linear]) -> dict:
    """The Linears that have both int4 and dense weights, by shape ("OUTxIN"): each shape's share one
    crossover."""
    groups: dict = {}
    for linear in linears:
        if linear.dense is not None and linear.quant is not None:
            groups.setdefault("x".join(map(str, linear.dense.shape)), []).append(linear)
    return groups


def calibrate(linears: list[Linear], known: dict | None = None) -> Iterator[tuple[str, int]]:
    """Give every Linear that has both int4 and dense weights the crossover of its shape: from
    ``known`` ({"OUTxIN": rows}, an earlier measurement), else measured (``crossover``, a second or
    so a shape). Yields (shape, rows) as each shape is done, so a caller can do other work between."""
    for key, group in by_shape(linears).items():
        rows = (known or {}).get(key)
        if rows is None:
            rows = crossover(group)
        for linear in group:
            linear.crossover = rows
        yield key, rows
