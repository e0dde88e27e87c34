"""Decode attention over each row's own columns, so short rows stop paying for a long row's span.

The batch's KV buffer is left-padded: every row ends at the same column, so a
row's keys start where its tokens do and everything before is masked padding.
With one long conversation in the batch, plain SDPA makes every row attend over
the longest row's span (5 rows, one of 2174 tokens: a decode step took 106 ms
here against 60 for the 4 short rows alone). For a decode step the engine passes
``spans``: runs of consecutive rows and the first column each run needs; each
run gets its own SDPA call over its own columns.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
# transformers' SDPA forward, imported by ``use``: its masking module pulls in torch._dynamo (~80 MB of memory
# and a second of start-up), which the engine's own decoder never needs
sdpa_attention_forward = None

NAME = "chat_spans"
CALL_COLUMNS = 512  # what one more SDPA call per layer costs, in row-columns of attention (measured: ~1 ms/step)


def spans_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, spans: list | None = None, **kwargs) -> tuple:
    """transformers' SDPA attention; for a decode step with ``spans``, one call per run of rows."""
    assert sdpa_attention_forward is not None, "attention.use first"
    if spans is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for begin, end, column in spans:
        mask = attention_mask[begin:end, ..., column:] if attention_mask is not None else None
        out, _ = sdpa_attention_forward(module, query[begin:end], key[begin:end, :, column:],
                                        value[begin:end, :, column:], mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs), None


def use(model: torch.nn.Module) -> None:
    """Make ``model`` attend through :func:`spans_attention` (its masks are SDPA's); a model that
    cannot keeps its own attention, which ignores ``spans``."""
    global sdpa_attention_forward
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, spans_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError) as exc:
        log.warning("decode attention over the whole batch's span: %s", exc)


def plan(starts: list[int], width: int) -> list[tuple[int, int, int]] | None:
    """Runs of consecutive rows ``(begin, end, first column)`` for rows whose tokens start at
    ``starts`` (columns of ``width``), split where a separate call costs less than the padding
    it saves; None when one call over everything is as good."""
    runs, begin, column = [], 0, starts[0]
    for i in range(1, len(starts)):
        merged = (i + 1 - begin) * (width - min(column, starts[i]))
        separate = (i - begin) * (width - column) + (width - starts[i]) + CALL_COLUMNS
        if merged <= separate:
            column = min(column, starts[i])
        else:
            runs.append((begin, i, column))
            begin, column = i, starts[i]
    runs.append((begin, len(starts), column))
    if len(runs) == 1:
        return None
    return runs
