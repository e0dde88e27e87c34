"""Structured answers on the bundled model, in-process (the ``structured`` phase): 50 prompts over 5
schemas answered with and without ``json_schema`` (the share that parses and validates), 8 constrained
rows' aggregate tok/s beside 8 free ones and the masks' own cost per step, 1 and 8 rows closed by
their budget beside free ones (``budget``), each schema's first compile, and /v1/completions-style
prompt scoring against a token-by-token decoder run.

``.venv/bin/python -m bench.structured [REPS [PARTS]]`` prints one JSON line (PARTS: some of
compile,validity,mask,budget,scoring); CHAT_* variables choose the model.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from .schemas import SCHEMAS, prompts

BATCH = 8
ESSAY = "Write a long, detailed essay about the history of {}."
TOPICS = ["bread", "ships", "clocks", "paper", "glass", "maps", "bridges", "music"]
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
             "required": ["text"], "additionalProperties": False}


def _json_in(text: str):
    """The object a free answer holds (between its first '{' and last '}'), or None."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        return json.loads(text[start:end + 1])
    except ValueError:
        return None


def _run(engine, jobs):
    """Submit (messages, params) jobs BATCH at a time; (text, done event) of each, in order."""
    from chat.engine import Delta, Done
    out = []
    for i in range(0, len(jobs), BATCH):
        gens = [engine.submit(m, p) for m, p in jobs[i:i + BATCH]]
        for g in gens:
            events = list(g)
            out.append(("".join(e.text for e in events if isinstance(e, Delta)),
                        next(e for e in events if isinstance(e, Done))))
    return out


def validity(engine) -> dict:
    import jsonschema

    from chat import structured
    from chat.engine import GenParams
    asked = prompts()
    result = {}
    for mode in ("free", "json_schema"):
        jobs = [([{"role": "user", "content": q}],
                 GenParams(temperature=0, max_new_tokens=300,
                           grammar=structured.schema_grammar(SCHEMAS[name]) if mode == "json_schema" else None))
                for name, q in asked]
        started = time.perf_counter()
        answers = _run(engine, jobs)
        ok = 0
        for (name, _), (text, _done) in zip(asked, answers):
            value = json.loads(text) if mode == "json_schema" and _done.reason == "stop" else _json_in(text)
            try:
                jsonschema.validate(value, SCHEMAS[name])
                ok += value is not None
            except jsonschema.ValidationError:
                pass
        result[mode] = {"valid": ok, "of": len(asked), "percent": 100 * ok / len(asked),
                        "seconds": round(time.perf_counter() - started, 1),
                        "example": answers[0][0][:300]}
    return result


def mask_cost(engine, reps: int) -> dict:
    """8 rows that cannot end within the budget, constrained (a 2000-character string: most of the
    vocabulary allowed, the dearest kind of mask) or free; aggregate tok/s, alternating runs."""
    from chat import structured
    from chat.engine import GenParams
    from chat.engine.core import grammar
    spent: list[float] = []
    original = grammar.apply_masks

    def timed(logits, slots):
        t0 = time.perf_counter()
        failed = original(logits, slots)
        if any(s.matcher is not None for s in slots):
            spent.append(time.perf_counter() - t0)
        return failed

    grammar.apply_masks = timed
    g = structured.schema_grammar(LONG_TEXT)
    rates: dict = {"free": [], "constrained": []}
    try:
        for _ in range(reps):
            for mode in ("free", "constrained"):
                jobs = [([{"role": "user", "content": ESSAY.format(t)}],
                         GenParams(temperature=0, max_new_tokens=64, grammar=g if mode == "constrained" else None))
                        for t in TOPICS]
                started = time.perf_counter()
                answers = _run(engine, jobs)
                tokens = sum(d.usage["completion_tokens"] for _, d in answers)
                rates[mode].append(tokens / (time.perf_counter() - started))
    finally:
        grammar.apply_masks = original
    ratios = [c / f for c, f in zip(rates["constrained"], rates["free"])]
    return {"free_tok_s": [round(r, 1) for r in rates["free"]],
            "constrained_tok_s": [round(r, 1) for r in rates["constrained"]],
            "ratio_p50": round(statistics.median(ratios), 3),
            "mask_ms_per_step_8_rows": round(1000 * statistics.median(spent), 3) if spent else None,
            "step_ms": round(engine.batch.step_s * 1000, 1)}


FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
             "additionalProperties": False}


def budget_cost(engine, reps: int) -> dict:
    """1 and 8 rows whose one string runs into the budget, so the close (chat/engine/budget.py) looks for
    the ending at every one of the last tokens and then writes it: constrained beside free, aggregate
    tok/s over alternating runs (the issue's target: at most 10% slower)."""
    from chat import structured
    from chat.engine import GenParams
    from chat.engine.core import grammar
    g = structured.schema_grammar(FREE_TEXT)
    out: dict = {}
    original = grammar.settle
    spent: list[float] = []

    def timed(slots, tokens):  # the close's own work: the endings looked for after each sampled token
        t0 = time.perf_counter()
        taken = original(slots, tokens)
        if any(s.guard is not None for s in slots):
            spent.append(time.perf_counter() - t0)
        return taken

    grammar.settle = timed
    for rows in (1, BATCH):
        rates: dict = {"free": [], "constrained": []}
        spent.clear()
        for _ in range(reps):
            for mode in ("free", "constrained"):
                jobs = [([{"role": "user", "content": ESSAY.format(t)}],
                         GenParams(temperature=0, max_new_tokens=64, grammar=g if mode == "constrained" else None))
                        for t in TOPICS[:rows]]
                started = time.perf_counter()
                answers = _run(engine, jobs)
                tokens = sum(d.usage["completion_tokens"] for _, d in answers)
                rates[mode].append(tokens / (time.perf_counter() - started))
        ratios = [c / f for c, f in zip(rates["constrained"], rates["free"])]
        out[f"rows_{rows}"] = {"free_tok_s": [round(r, 1) for r in rates["free"]],
                               "constrained_tok_s": [round(r, 1) for r in rates["constrained"]],
                               "ratio_p50": round(statistics.median(ratios), 3),
                               "close_ms_per_step_p50": round(1000 * statistics.median(spent), 3),
                               "close_ms_per_step_p90": round(1000 * sorted(spent)[int(0.9 * len(spent))], 3),
                               "step_ms": round(engine.step_s * 1000, 1)}
    grammar.settle = original
    return out


def compile_times(engine) -> dict:
    from chat import structured
    from chat.engine.core.grammar import Grammars
    fresh = Grammars(engine.loaded.tokenizer, engine.loaded.eos_ids, engine.grammars.vocab)
    t0 = time.perf_counter()
    fresh.tokenizer  # noqa: B018 (the one-off tokenizer conversion, timed apart)
    out = {"tokenizer_ms": round(1000 * (time.perf_counter() - t0), 1)}
    for name, schema in SCHEMAS.items():
        grammar = structured.schema_grammar(schema)
        t0 = time.perf_counter()
        fresh.matcher(grammar)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.matcher(grammar)
        out[name] = {"first_ms": round(1000 * first, 2), "cached_ms": round(1000 * (time.perf_counter() - t0), 3)}
    out["max_first_ms"] = max(v["first_ms"] for k, v in out.items() if k in SCHEMAS)
    return out


def scoring(engine) -> dict:
    """Every token's log probability of bench/quality.py's text: the engine's prompt scoring against
    quality.py's own token-by-token decoder run."""
    import torch

    from bench.quality import TEXT
    from chat.engine import Delta, GenParams
    events = list(engine.submit([{"role": "user", "content": TEXT}],
                                GenParams(max_new_tokens=0, prompt_logprobs=0, raw_prompt=True)))
    got = [e["logprob"] for d in events if isinstance(d, Delta) for e in d.prompt_logprobs][1:]
    ids = engine.loaded.tokenizer.encode(TEXT)
    decoder = engine.decoder
    ref = []
    with torch.inference_mode():
        kv = decoder.cache(1, len(ids) + 8)
        for i in range(len(ids) - 1):
            kv.reserve(1)
            kv.mask[0, kv.length] = 1
            logits = decoder(torch.tensor([[ids[i]]]), kv, torch.tensor([[i]]))
            kv.length += 1
            ref.append(float(torch.log_softmax(logits[0], dim=-1)[ids[i + 1]]))
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    # On the C++ step the prompt is scored through its columns, each a decode step's arithmetic: the same
    # bits. Without it (torch's step) a prompt's multi-column forward rounds apart from single steps.
    return {"tokens": len(ref), "sum_engine": round(sum(got), 4), "sum_reference": round(sum(ref), 4),
            "sum_diff_per_token": abs(sum(got) - sum(ref)) / len(ref),
            "max_diff_per_token": max(diffs), "mean_diff_per_token": sum(diffs) / len(diffs)}


def main() -> None:
    import threading

    from chat.config import Settings
    from chat.engine.core.local import LocalEngine
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["compile", "validity", "mask", "budget", "scoring"]
    engine = LocalEngine(Settings.from_env(None, max_batch=BATCH * 2))
    deadline = time.monotonic() + 600
    while not engine.ready and engine.error is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not engine.ready:
        raise SystemExit(f"the engine did not start: {engine.error}")
    while engine.stats()["finishing"] and time.monotonic() < deadline:  # idle-time chores (the C++ step)
        time.sleep(0.5)
    result: dict = {"model": engine.model_name, "weights": engine.describe()["weights"]}
    done = threading.Event()

    def work() -> None:  # off the main thread, as the server runs it (design.md)
        try:
            if "compile" in parts:
                result["compile"] = compile_times(engine)
            if "validity" in parts:
                result["validity"] = validity(engine)
            if "mask" in parts:
                result["mask"] = mask_cost(engine, reps)
            if "budget" in parts:
                result["budget"] = budget_cost(engine, reps)
            if "scoring" in parts and engine.decoder is not None:
                result["scoring"] = scoring(engine)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            done.set()

    threading.Thread(target=work).start()
    done.wait()
    engine.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
