"""The model runner: carries out the forwards the scheduler planned, on one of two implementations.

``DecoderRunner`` runs the engine's own decoder (``decoder.py``; decode steps in C++ once
``native`` is attached), ``TransformersRunner`` runs transformers' forward for every other
architecture. Both take the same calls (a prefill chunk of a ``PrefillJob``, a decode step of the
batch's ``KVBuffer``) and return float logits; ``runner_for`` picks one, once, at load.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch

from ...config import Settings
from ..base import GenParams
from ..kv.buffer import KVBuffer
from . import attention, native
from . import loader as model_loader
from .decoder import Decoder
from .prefill import PrefillJob
from .sampling import sample

log = logging.getLogger(__name__)

# a KV buffer's layers, heads, head dim, dtype, device, and the columns a row taken out keeps per layer (``KVBuffer``'s
# keep: windowed layers'; empty: all)
Dims = tuple[int, int, int, torch.dtype, torch.device, tuple[int, ...]]


class ModelRunner(Protocol):
    """What the engine asks of the model: forwards over a KV buffer, and what shapes its buffers."""

    dims: Dims
    vocab_size: int
    decoder: Decoder | None  # the own decoder, where it runs

    @property
    def weights(self) -> str:
        """What a decode step multiplies by: "int4", "bfloat16", ... (the idle chores may change it)."""
        ...

    @property
    def native(self) -> bool:
        """Decode steps run in C++: they read no padding column of the batch's buffer."""
        ...

    @property
    def wide_prefill(self) -> bool:
        """Prefill runs on dense products (dense weights, or copies beside quantized ones): a forward of many
        rows costs little more than one of a few."""
        ...

    def forward(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor, spans: list | None = None,
                every: bool = False) -> torch.Tensor:
        """Feed ``input_ids`` (rows, columns) into ``kv``'s open columns: each row's last logits (``every``: all)."""
        ...

    def prefill(self, job: PrefillJob, columns: int) -> torch.Tensor | None:
        """The job's next ``columns`` prompt positions; its last position's logits once it is done."""
        ...

    def decode(self, kv: KVBuffer, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for every row of ``kv``: their next-token logits (rows, vocab)."""
        ...

    def verifies(self, columns: int) -> bool:
        """Whether a lone row's drafted tokens can be checked ``columns`` at a time (``verify``)."""
        ...

    def verify(self, kv: KVBuffer, tokens: list[int], position: int) -> torch.Tensor:
        """Feed a lone row's ``tokens`` (its last and its drafts) from ``position``: every column's logits
        (columns, vocab), each exactly a decode step's. The columns stay open: the caller advances ``kv``
        over those that hold the answer's tokens."""
        ...

    def verifies_rows(self) -> bool:
        """Whether several rows' drafted tokens can be checked in one step, each its own columns (``verify_rows``)."""
        ...

    def verify_rows(self, kv: KVBuffer, tokens: list[list[int]], positions: list[int]) -> torch.Tensor:
        """Feed each row of ``kv`` its ``tokens`` (its last and its drafts, if any) from its position: every column's
        logits (all rows' columns, row after row, vocab), each exactly a decode step of that row alone. The caller
        then keeps each row's columns that hold its answer's tokens (``settle``)."""
        ...

    def settle(self, kv: KVBuffer, kept: list[int], opened: int) -> None:
        """After ``verify_rows`` (``opened``: its longest row's columns): row r keeps its first ``kept[r]`` columns."""
        ...

    def sampler(self) -> Callable[..., list[int]] | None:
        """The C++ sampler where the step runs in C++ (``sampling.sample``'s ``native``), else None."""
        ...

    def formats(self) -> dict[str, str] | None:
        """What each class of product multiplies by (``Decoder.formats``), or None."""
        ...

    def chores(self, settings: Settings) -> Iterator[None]:
        """Idle work after start-up, a step per idle iteration of the engine."""
        ...

    def warm_up(self, ids: list[int]) -> float:
        """A tiny generation from prompt ``ids``, so the first user pays for no lazy initialisation; what its
        last decode step took (seconds: the start-up line's measured speed)."""
        ...


EXACT_SCORE = 256  # scored prompt tokens fed as decode steps (bit for bit theirs); past it, batched prefill


class _Runner:
    """What both runners share: prefill chunks, decode steps and the warm-up, on top of ``forward``."""

    dims: Dims
    decoder: Decoder | None = None

    def __init__(self, loaded: model_loader.LoadedModel) -> None:
        self.loaded = loaded

    @property
    def native(self) -> bool:
        return False

    @property
    def wide_prefill(self) -> bool:
        return self.decoder is None or any(linear.dense is not None for linear in self.decoder.linears())

    def forward(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor, spans: list | None = None,
                every: bool = False) -> torch.Tensor:
        """The next-token logits of every row after feeding ``input_ids`` (rows, columns); ``every``:
        of every column (rows, columns, vocab)."""
        raise NotImplementedError

    def prefill(self, job: PrefillJob, columns: int) -> torch.Tensor | None:
        """The job's next ``columns`` prompt positions; its last position's logits once it is done."""
        tokens, positions = job.open(columns)
        if job.score is None:
            return job.ran(self.forward(tokens, job.kv, positions))
        return job.ran(self.forward(tokens, job.kv, positions, every=True))  # every position's, to score

    def decode(self, kv: KVBuffer, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode forward for every row of ``kv``: next-token logits."""
        device = self.loaded.device
        kv.open(1)
        # the torch step's runs of rows (the C++ step takes each row's own columns itself)
        spans = attention.plan(kv.row_starts(1), kv.length + 1 - kv.start) if kv.n > 1 and not self.native else None
        logits = self.forward(torch.tensor(tokens, device=device)[:, None], kv,
                              torch.tensor(positions, device=device)[:, None], spans)
        kv.advance(1)
        return logits

    def verifies(self, columns: int) -> bool:
        return False

    def verify(self, kv: KVBuffer, tokens: list[int], position: int) -> torch.Tensor:
        raise NotImplementedError

    def verifies_rows(self) -> bool:
        return False

    def verify_rows(self, kv: KVBuffer, tokens: list[list[int]], positions: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def settle(self, kv: KVBuffer, kept: list[int], opened: int) -> None:
        raise NotImplementedError

    def sampler(self) -> Callable[..., list[int]] | None:
        """The C++ sampler once the C++ decode step is in (the same library)."""
        return native.sample if self.native else None

    def formats(self) -> dict[str, str] | None:
        return None

    def chores(self, settings: Settings) -> Iterator[None]:
        """Idle work after start-up, a step per idle turn of the engine."""
        return iter(())

    def warm_up(self, ids: list[int]) -> float:
        """Run a tiny generation from prompt ``ids``, chunked and sampled, so the first user pays for no lazy
        initialisation; what its last decode step took."""
        started = time.monotonic()
        job = PrefillJob([ids], self.dims)
        logits = self.prefill(job, len(ids) // 2)
        logits = logits if logits is not None else self.prefill(job, len(ids))
        assert logits is not None
        params, generator = [GenParams(temperature=0.7, top_p=0.9)], [torch.Generator().manual_seed(0)]
        step_s = 0.0
        for i in range(3):
            token = sample(logits, params, generator)[0]
            stepped = time.monotonic()
            logits = self.decode(job.kv, [token], [len(ids) + i])
            step_s = time.monotonic() - stepped
        log.info("warm-up took %.2f s", time.monotonic() - started)
        return step_s


class DecoderRunner(_Runner):
    """The own decoder (Llama-shaped architectures, ``architecture.py``); decode steps in C++ once attached."""

    def __init__(self, loaded: model_loader.LoadedModel, decoder: Decoder) -> None:
        super().__init__(loaded)
        self.decoder = decoder
        s = decoder.shape
        self.dims = (s.layers, s.kv_heads, s.head_dim, loaded.dtype, loaded.device, decoder.keep)
        self.vocab_size = s.vocab
        self._checked: tuple[Any, dict] = (None, {})  # (the step checked, {columns or "rows": whether it agreed})

    @property
    def weights(self) -> str:
        assert self.decoder is not None
        return self.decoder.weights

    @property
    def native(self) -> bool:
        """Decode steps run in C++ (``native``): built and checked while idle after start-up."""
        assert self.decoder is not None
        return bool(self.decoder.native)

    def forward(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor, spans: list | None = None,
                every: bool = False) -> torch.Tensor:
        assert self.decoder is not None
        return self.decoder(input_ids, kv, position_ids, spans, every=every)

    def formats(self) -> dict[str, str] | None:
        assert self.decoder is not None
        return self.decoder.formats()

    def prefill(self, job: PrefillJob, columns: int) -> torch.Tensor | None:
        """A scored prompt (every position's log probability, always a job of its own) of up to EXACT_SCORE
        tokens goes through the C++ step once it is in, its columns together: each position's log
        probabilities are then the ones decode steps feeding the text token by token give (bit for bit where
        ``verifies``), not a prefill's other rounding. Those columns cost a decode step each (the products'
        one-row kernels), so a longer prompt is scored by the batched prefill like any other: a 1600-token
        prompt took 64 s of them."""
        assert self.decoder is not None
        if job.score is not None and job.rows == 1 and self.native and job.tokens.shape[1] <= EXACT_SCORE:
            tokens, positions = job.open(columns)
            return job.ran(self.decoder.verify(tokens, job.kv, positions).view(*tokens.shape, -1))
        return super().prefill(job, columns)

    def verifies(self, columns: int) -> bool:
        """On the C++ step with products that take one path for any rows, once checked on this machine that
        its columns come out bit for bit as single steps (``native.columns_agree``; again after the step
        changes)."""
        decoder = self.decoder
        assert decoder is not None
        if not decoder.native:
            return False
        if self._checked[0] is not decoder.native:  # once per step (and width)
            self._checked = (decoder.native, {})
        known = self._checked[1]
        if columns not in known:
            known[columns] = decoder.same_path(columns) and native.columns_agree(decoder, columns)
        return known[columns]

    def verifies_rows(self) -> bool:
        """Rows of different lengths, each its own number of columns, come out of one step as each alone
        (``native.rows_agree``: once per C++ step)."""
        decoder = self.decoder
        assert decoder is not None
        if not decoder.native:
            return False
        self.verifies(1)  # the check's cache, for this step
        known = self._checked[1]
        if "rows" not in known:
            known["rows"] = native.rows_agree(decoder)
        return known["rows"]

    def verify_rows(self, kv: KVBuffer, tokens: list[list[int]], positions: list[int]) -> torch.Tensor:
        assert self.decoder is not None
        return self.decoder.verify_rows(tokens, kv, positions)

    def settle(self, kv: KVBuffer, kept: list[int], opened: int) -> None:
        kv.settle(kept, opened, native.shift)

    def verify(self, kv: KVBuffer, tokens: list[int], position: int) -> torch.Tensor:
        assert self.decoder is not None
        kv.open(len(tokens))
        positions = torch.arange(position, position + len(tokens))[None]
        return self.decoder.verify(torch.tensor(tokens)[None], kv, positions)

    def chores(self, settings: Settings) -> Iterator[None]:
        return model_loader.finish(self.loaded, settings)


class TransformersRunner(_Runner):
    """transformers' forward, for the architectures the own decoder does not run, writing into the same
    ``KVBuffer`` (its cache layers) and attending over each run of rows' own columns (``attention``)."""

    def __init__(self, loaded: model_loader.LoadedModel) -> None:
        super().__init__(loaded)
        self.model: Any = cast(Any, loaded.model)  # a transformers model (checked as Any)
        attention.use(self.model)
        cfg = self.model.config.get_text_config(decoder=True)
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dims = (cfg.num_hidden_layers, heads, head_dim, loaded.dtype, loaded.device, ())
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.weights = str(loaded.dtype).removeprefix("torch.")

    def forward(self, input_ids: torch.Tensor, kv: KVBuffer, position_ids: torch.Tensor, spans: list | None = None,
                every: bool = False) -> torch.Tensor:
        model = self.model
        out = model.get_decoder()(input_ids=input_ids, attention_mask=kv.attention_mask(input_ids.shape[1]),
                                  position_ids=position_ids, cache=kv.cache, use_cache=True, spans=spans)
        # The output head on a 2-D (rows, hidden) input. Given the model's own 3-D slice of a
        # multi-column forward, torch's matmul takes its batched path, which copies the whole
        # bf16 output matrix once per row when the weights are inference tensors (as they are
        # when loaded under gevent): 0.4 s of a 7-prompt prefill.
        if every:
            rows, cols = input_ids.shape
            return model.get_output_embeddings()(out.last_hidden_state.reshape(rows * cols, -1)).float().view(
                rows, cols, -1)
        return model.get_output_embeddings()(out.last_hidden_state[:, -1, :]).float()


def release_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps it otherwise): after loading, and once the batch empties."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def runner_for(loaded: model_loader.LoadedModel) -> ModelRunner:
    """The own decoder's runner where one was loaded, else transformers'."""
    if loaded.decoder is not None:
        return DecoderRunner(loaded, loaded.decoder)
    return TransformersRunner(loaded)
