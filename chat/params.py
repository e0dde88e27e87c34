"""Sampling parameters as clients send them (WebSocket ``params``, ``/v1`` fields, a conversation's
settings): the rules, one table for every transport."""
from __future__ import annotations

import math

SEED_RANGE = (-(2 ** 63), 2 ** 64)  # what torch.manual_seed accepts (the upper end excluded)
TOP_K_MAX = 1_000_000  # without a model to ask (a remote backend), the most top_k may be


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """An int (of any size: the rules compare it exactly) or a finite float; never a bool."""
    if isinstance(v, float):
        return math.isfinite(v)
    return _is_int(v)


def rules(max_new_tokens: int | None = None, vocab: int | None = None) -> dict:
    """name -> (check, what it must be); ``max_new_tokens`` None: no upper bound (capped at each turn);
    ``vocab``: the model's vocabulary, top_k's upper bound when it is known."""
    most = max_new_tokens or 2 ** 31
    top_k = min(TOP_K_MAX, vocab) if vocab else TOP_K_MAX
    return {
        "temperature": (lambda v: _is_number(v) and 0 <= v <= 2, "a number from 0 to 2"),
        "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number greater than 0 and at most 1"),
        "top_k": (lambda v: _is_int(v) and 0 <= v <= top_k, f"an integer from 0 (off) to {top_k}"),
        "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 (off) to 1"),
        "max_new_tokens": (lambda v: _is_int(v) and 1 <= v <= most,
                           f"an integer from 1 to {most}" if max_new_tokens else "an integer of at least 1"),
        "seed": (lambda v: _is_int(v) and SEED_RANGE[0] <= v < SEED_RANGE[1],
                 f"an integer from {SEED_RANGE[0]} to {SEED_RANGE[1] - 1}"),
        # a thinking model's switch (its template's ``enable_thinking``); other models ignore it
        "enable_thinking": (lambda v: isinstance(v, bool), "true or false"),
    }


def check(name: str, value: object, max_new_tokens: int | None = None, vocab: int | None = None) -> str | None:
    """What parameter ``name`` must be when ``value`` breaks its rule (None when it keeps it)."""
    rule = rules(max_new_tokens, vocab)[name]
    return None if rule[0](value) else rule[1]


def problem(params: object, max_new_tokens: int | None = None, where: str = "params",
            vocab: int | None = None) -> str | None:
    """Why ``params`` is not a valid parameter object (None when it is); unknown names are ignored."""
    if not isinstance(params, dict):
        return f"{where} must be an object"
    table = rules(max_new_tokens, vocab)
    for name, value in params.items():
        rule = table.get(name)
        if rule is not None and value is not None and not rule[0](value):
            return f"{where}.{name} must be {rule[1]}"
    return None


def clean(params: dict | None) -> dict:
    """The known, set parameters of a valid object (unknown names and nulls dropped)."""
    known = rules()
    return {k: v for k, v in (params or {}).items() if k in known and v is not None}
