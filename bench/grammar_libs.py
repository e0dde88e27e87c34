"""Which constrained-decoding library: llguidance, xgrammar and outlines-core on the bundled
49,152-token vocabulary and on a 151,936-token one (the bundled BPE grown by merging pairs of its
own tokens, so the extra tokens are real, longer strings as in Qwen2.5's vocabulary).

For each library and schema (``bench/schemas.py``): the first compile (a fresh compiler, no cache),
the mean time to compute one row's mask per step while walking a valid answer's tokens, and the
process's resident memory growth. ``.venv/bin/python -m bench.grammar_libs`` prints a JSON line.
"""
from __future__ import annotations

import gc
import json
import resource
import sys
import time

from .schemas import EXAMPLES, SCHEMAS

QWEN_VOCAB = 151_936


def rss_mb() -> float:
    """The resident set size now, MiB (from /proc, not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def grown_tokenizer(base, size: int):
    """``base`` (a byte-level BPE fast tokenizer) with merges of its own token pairs up to ``size`` tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    words = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t.isalpha() and len(t) > 1][:2000]
    added = {a["id"] for a in spec.get("added_tokens", [])}
    next_id = max(max(vocab.values()), max(added, default=0)) + 1
    for a in words:
        for b in words:
            if next_id >= size:
                break
            if a + b not in vocab:
                vocab[a + b] = next_id
                merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
                next_id += 1
        if next_id >= size:
            break
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    tok.eos_token = base.eos_token
    return tok


def _walk(tokenizer, name):
    return tokenizer.encode(json.dumps(EXAMPLES[name]), add_special_tokens=False)


def bench_llguidance(tokenizer, n_vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)
    setup = time.perf_counter() - t0
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        mask = lt.allocate_token_bitmask(1, n_vocab)
        fills = []
        for token in _walk(tokenizer, name):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            fills.append(time.perf_counter() - t0)
            assert matcher.consume_token(token), matcher.get_error()
        out[name] = (compile_s, sum(fills) / len(fills))
    return setup, out


def bench_xgrammar(tokenizer, n_vocab):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=n_vocab)
    setup = time.perf_counter() - t0
    out = {}
    for name, schema in SCHEMAS.items():
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, n_vocab)
        fills = []
        for token in _walk(tokenizer, name):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            fills.append(time.perf_counter() - t0)
            assert matcher.accept_token(token)
        out[name] = (compile_s, sum(fills) / len(fills))
    return setup, out


def bench_outlines(tokenizer, n_vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    t0 = time.perf_counter()
    decode = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    tokens: dict = {}
    for token, tid in tokenizer.get_vocab().items():
        if tid not in special:
            tokens.setdefault(bytes(decode.get(c, 0) for c in token), []).append(tid)
    vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
    setup = time.perf_counter() - t0
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
        compile_s = time.perf_counter() - t0
        mask = allocate_token_bitmask(n_vocab)
        fills = []
        for token in _walk(tokenizer, name):
            t0 = time.perf_counter()
            fill_next_token_bitmask(guide, mask)
            fills.append(time.perf_counter() - t0)
            guide.advance(token)
        out[name] = (compile_s, sum(fills) / len(fills))
    return setup, out


LIBS = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def main() -> None:
    from chat.engine.model.loader import bundled_gguf, gguf_tokenizer
    base = gguf_tokenizer(bundled_gguf())
    which = sys.argv[1:] or list(LIBS)
    results = {}
    for label, tokenizer in (("49152", base), ("151936", grown_tokenizer(base, QWEN_VOCAB))):
        n_vocab = len(tokenizer)
        for lib in which:
            gc.collect()
            before = rss_mb()
            try:
                setup, per = LIBS[lib](tokenizer, n_vocab)
            except Exception as exc:  # one library failing is itself a result
                results[f"{lib}@{label}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            results[f"{lib}@{label}"] = {
                "vocab": n_vocab, "tokenizer_setup_ms": round(setup * 1000, 1),
                "compile_ms": {k: round(v[0] * 1000, 2) for k, v in per.items()},
                "mask_us_per_row_step": {k: round(v[1] * 1e6, 1) for k, v in per.items()},
                "rss_growth_mb": round(rss_mb() - before, 1)}
            print(lib, label, json.dumps(results[f"{lib}@{label}"]), file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
