"""Prompts being prefilled, a chunk at a time, in their own buffer until they join the batch."""
from __future__ import annotations

import torch

from ..kv.buffer import KVBuffer

MIN_CHUNK = 16  # prompt tokens: a long prompt still advances when its chunks cost more than planned


class PrefillJob:
    """Prompts prefilled together (left-padded, one forward per chunk), or one continuing reused KV.

    ``dims`` is (layers, heads, head dim, dtype, device[, the columns a row taken out keeps per layer]);
    ``reused`` is (keys, values, n)
    from the prefix cache for a single prompt whose first ``n`` tokens are already done.
    """

    def __init__(self, prompts: list, dims: tuple, reused: tuple | None = None) -> None:
        layers, heads, dim, dtype, device, *keep = dims
        self.slots: list = []  # the engine's rows-to-be, in prompt order
        self.shared = reused is None  # later fresh prompts may join it before its first chunk
        width = max(len(ids) for ids in prompts)
        active = 0 if reused is not None else len(prompts)
        self.kv = KVBuffer(layers, heads, dim, dtype, device, rows=len(prompts), capacity=width + 64, active=active,
                           keep=keep[0] if keep else None)
        if reused is not None:
            keys, values, start = reused
            self.kv.add_row(keys, values)
            ids = prompts[0]
            self.tokens = torch.tensor([ids[start:]], device=device)
            self.positions = torch.arange(start, len(ids), device=device)[None, :]
            self.pads = [0]
        else:
            self.tokens = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
            self.positions = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
            self.pads = [width - len(ids) for ids in prompts]
            for r, (ids, pad) in enumerate(zip(prompts, self.pads)):
                self.tokens[r, pad:] = torch.tensor(ids, device=device)
                self.positions[r, pad:] = torch.arange(len(ids), device=device)
        self.real = (torch.arange(self.tokens.shape[1], device=device)[None, :]
                     >= torch.tensor(self.pads, device=device)[:, None]).long()
        self.done = 0
        self.score: int | None = None  # set: score every prompt token (this many alternatives each)
        self.scores: list | None = None  # per row: (token id, logprob or None, [(id, logprob)...])
        self.columns = 0  # this job's next chunk size from its last chunk's cost (0: not measured yet)
        self.end = 0  # the prompt position the open chunk ends at
        self.logits: torch.Tensor | None = None  # the last position's, once done (until the rows join the batch)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def remaining(self) -> int:
        return self.tokens.shape[1] - self.done

    def chunk(self, budget: int) -> int:
        """Columns for the next chunk: ``budget`` prompt tokens shared by the rows, cut to what the
        last chunk's measured cost allows."""
        return max(1, min(budget // self.rows, self.columns or budget))

    def measured(self, columns: int, spent: float, step_s: float, target: float) -> None:
        """Size the next chunk to take ``target`` seconds. A forward costs about a decode step
        (``step_s``) whatever its size, plus its tokens, which cost more the deeper the prompt; the
        next chunk is as deep or a little deeper. A slow (noisy) chunk shrinks the next, a cheap one
        lets it grow back."""
        over = max(spent - step_s, 1e-3)
        self.columns = max(MIN_CHUNK, int(columns * (target - step_s) / over))

    def open(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next chunk's inputs, (token ids, positions) of ``columns`` more prompt positions per row, their
        KV columns opened; the runner's forward over them goes to ``ran``."""
        begin = self.done
        self.end = min(begin + columns, self.tokens.shape[1])
        self.kv.open(self.end - begin, self.real[:, begin:self.end])
        return self.tokens[:, begin:self.end], self.positions[:, begin:self.end]

    def ran(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The chunk ``open`` gave ran and made ``logits`` (its last column's; every column's when scoring):
        the prompt's last position's logits once the job is done (kept as ``logits`` until it joins the
        batch), else None."""
        kv, begin, end = self.kv, self.done, self.end
        if self.score is not None:
            self._score(logits, begin, end)
            logits = logits[:, -1]
        for r, pad in enumerate(self.pads):
            if pad > begin:  # padding attends to nothing; keep its never-read KV finite
                kv.clear(r, min(pad, end) - begin)
        kv.advance(end - begin)
        self.done = end
        if self.done == self.tokens.shape[1]:
            self.logits = logits
        return self.logits

    def _score(self, logits: torch.Tensor, begin: int, end: int) -> None:
        """Each prompt token's log probability given the ones before it (columns begin..end predict
        the tokens after them), from the unmodified distribution."""
        width = self.tokens.shape[1]
        if self.scores is None:
            self.scores = [[(int(self.tokens[r, pad]), None, [])] for r, pad in enumerate(self.pads)]
        targets = self.tokens[:, begin + 1:min(end + 1, width)]
        q = targets.shape[1]
        if q == 0:
            return
        lp = torch.log_softmax(logits[:, :q].float(), dim=-1)
        chosen = lp.gather(2, targets[:, :, None]).squeeze(2).tolist()
        top = lp.topk(self.score, dim=-1) if self.score else None
        ids = targets.tolist()
        for r, pad in enumerate(self.pads):
            for c in range(max(0, pad - begin), q):
                alts = list(zip(top.indices[r, c].tolist(), top.values[r, c].tolist())) if top is not None else []
                self.scores[r].append((ids[r][c], chosen[r][c], alts))
