"""What the benchmark asks: its prompts, and the workloads it runs against any server.

A workload takes ``connect()``, which opens one client with ``request(rid, content, params,
conversation_id=None, ...)`` returning a timing dict (``sent``, ``first``, ``done``, ``ttfd_s``,
``tokens``, ``tok_s``, ``prompt_tokens``, ``reason``, ``conversation_id``, ``delta_times``) and
``close()``: ``bench.server.Client`` speaks chat.v1 to this server, ``bench.peer.PeerClient``
speaks OpenAI-compatible streaming to llama.cpp's server, so both get the same work.
"""
from __future__ import annotations

import collections
import threading

from .stats import percentile

TOPICS = ["the history of the printing press", "how bridges carry heavy loads", "the life cycle of stars",
          "why the sea is salty", "how vaccines train the immune system", "the invention of the telephone",
          "how honey bees organise their hives", "the causes of the French Revolution",
          "how a car engine works", "the water cycle on Earth", "the rise of the Roman Empire",
          "how computers store numbers", "the migration of birds", "how volcanoes form",
          "the history of chess", "how trains changed the nineteenth century"]

NOTES = ["The committee met on a rainy Tuesday to review the budget for the new library wing.",
         "Three suppliers offered timber, and the cheapest one could deliver only in the spring.",
         "The architect insisted on large windows facing north so that the reading room stays cool.",
         "Volunteers counted 4,812 books that still need new labels before the move.",
         "A local school asked whether pupils could visit the archive once a month.",
         "The heating system is thirty years old and uses twice the energy of a modern one.",
         "Members disagreed about opening hours on Sundays, and the vote was postponed.",
         "The treasurer reported that donations rose by twelve percent compared with last year."]

SAMPLED = {"temperature": 0.7, "top_p": 0.9}
SAMPLING: dict = {}  # bench.run's --temperature, --top-p, --top-k, --min-p: every request sampled so (empty: greedy)
SEEDED = [True]  # False: bench.run's --unseeded, requests without a seed


def essay_prompt(i: int) -> str:
    """A distinct prompt that asks for a long answer."""
    topic = TOPICS[i % len(TOPICS)]
    return (f"Write a long, detailed essay about {topic}. Explain where it comes from, how it works, "
            f"who was involved and why it matters today, with concrete examples in every paragraph.")


def notes_message(turn: int, tokens: int) -> str:
    """A user message of about ``tokens`` tokens: numbered meeting notes, then a question."""
    parts, i = [f"Here are my notes from meeting {turn}."], 0
    while sum(len(p) for p in parts) / 4.3 < tokens:
        parts.append(f"({turn}.{i + 1}) {NOTES[(turn + i) % len(NOTES)]}")
        i += 1
    return " ".join(parts) + " Summarise these notes in two sentences."


def params(max_new_tokens: int, seed: int = 1) -> dict:
    """Seeded generation parameters (unless ``SEEDED`` says not): greedy, or as ``SAMPLING`` says."""
    out = {"temperature": 0, "max_new_tokens": max_new_tokens, "seed": seed, **SAMPLING}
    if not SEEDED[0]:
        del out["seed"]
    return out


def summarize(results: list[dict]) -> dict:
    """Medians and percentiles over finished requests."""
    ttfd = [r["ttfd_s"] for r in results]
    return {"n": len(results), "tokens": [r["tokens"] for r in results],
            "ttfd_p50_s": percentile(ttfd, 50), "ttfd_p95_s": percentile(ttfd, 95), "ttfd_max_s": max(ttfd),
            "tok_s_p50": percentile([r["tok_s"] for r in results], 50),
            "aggregate_tok_s_p50": percentile([r["tokens"] / (r["done"] - r["sent"]) for r in results], 50),
            "server_ttft_ms_p50": percentile([r.get("server_ttft_ms") for r in results], 50)}


SHORT_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
                   "Who wrote Romeo and Juliet?", "What gas do plants take in from the air?",
                   "Why do leaves change colour in autumn?", "What is the tallest mountain in the world?",
                   "How do magnets work?", "What language is spoken in Brazil?"]


def questions(connect, args, tag: str = "questions") -> dict:
    """A lone user's first message in a new conversation, eight different short questions one after another
    (after a warm-up): the first delta a person waits for (its median), each answer cut at 8 tokens."""
    client = connect()
    runs = []
    try:
        client.request(f"{tag}-warmup", "Say hello.", params(8))
        for i, question in enumerate(SHORT_QUESTIONS):
            runs.append(client.request(f"{tag}-{i}", question, params(8, seed=i + 1)))
    finally:
        client.close()
    ttfd = [r["ttfd_s"] for r in runs]
    return {"n": len(runs), "ttfd_p50_s": percentile(ttfd, 50), "ttfd_max_s": max(ttfd),
            "prompt_tokens": [r.get("prompt_tokens") for r in runs]}


def edit_prompt() -> str:
    """The "repeat / edit this text" workload: a ~300-token attachment the answer quotes with a small change."""
    text = " ".join(NOTES * 2)
    return f"Here is a text:\n\n{text}\n\nRepeat the text exactly, but write 'museum' instead of 'library'."


def single(connect, args, tag: str = "single", extra: dict | None = None, after=None, prompt: str | None = None,
           tokens: int | None = None) -> dict:
    """One stream at a time, ``args.reps`` times, after one discarded warm-up request; ``after()``
    (when given) runs after each request and its result is kept beside it in ``paired``. ``prompt`` and
    ``tokens``: other than the essay's and ``args.tokens``."""
    client = connect()
    runs, paired = [], []
    try:
        client.request(f"{tag}-warmup", essay_prompt(1), params(8))
        for i in range(args.reps):
            runs.append(client.request(f"{tag}-{i}", prompt or essay_prompt(0),
                                       {**params(tokens or args.tokens, seed=i + 1), **(extra or {})}))
            if after is not None:
                paired.append(after())
    finally:
        client.close()
    for r in runs:
        r.pop("delta_times", None)
    return {**summarize(runs), "runs": runs, "paired": paired}


def parallel(connect, n: int, request, meanwhile=None, timeout: float = 600):
    """(results, what ``meanwhile()`` returned): ``request(client, i)`` on n connections at once, one thread each,
    client i made by ``connect(i)`` (user i: its own address where the factory gives users one)."""
    clients = [connect(i) for i in range(n)]
    results: list = [None] * n

    def worker(i: int) -> None:
        try:
            results[i] = request(clients[i], i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        extra = meanwhile() if meanwhile is not None else None
        for t in threads:
            t.join(timeout)
    finally:
        for c in clients:
            c.close()
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} streams failed: {failed[0]!r}")
    return results, extra


def streams(connect, n: int, args, tag: str) -> dict:
    """``n`` clients, one connection each, sending different prompts at the same moment."""
    barrier = threading.Barrier(n)

    def request(client, i):
        barrier.wait(30)
        return client.request(f"{tag}-{n}-{i}", essay_prompt(i), params(args.tokens, seed=i + 1))

    results, _ = parallel(connect, n, request, timeout=args.timeout)
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    # while every stream decodes (from the last first delta to the first end): the batch's own pace, with
    # no prefill and no stream missing
    begin, end = max(r["first"] for r in results), min(r["done"] for r in results)
    inside = sum(1 for r in results for t in r.get("delta_times") or () if begin < t <= end)
    steady = inside / (end - begin) if end - begin > 0.2 and inside else None
    tokens = [r["tokens"] for r in results]
    rates = [r["tok_s"] for r in results]
    ttfd = [r["ttfd_s"] for r in results]
    return {"streams": n, "wall_s": wall, "tokens_total": sum(tokens), "tokens_min": min(tokens),
            "tokens_max": max(tokens), "aggregate_tok_s": sum(tokens) / wall, "steady_deltas_s": steady,
            "stream_tok_s_p50": percentile(rates, 50), "stream_tok_s_min": min(rates),
            "ttfd_p50_s": percentile(ttfd, 50), "ttfd_p95_s": percentile(ttfd, 95), "ttfd_max_s": max(ttfd),
            "reasons": dict(collections.Counter(r["reason"] for r in results))}


def multiturn(connect, args, reused=None) -> dict:
    """Six turns of one conversation with long user messages (about ``args.history_tokens`` of history
    before turn 6), ``args.multiturn_reps`` times; TTFD at turn 1 against turn 6. ``reused()``, when
    given, reads a counter of prompt tokens taken from the server's cache (read around each turn)."""
    answer = min(64, args.tokens)
    per_turn = max(20, args.history_tokens // 5 - answer - 10)
    convs = []
    for c in range(args.multiturn_reps):
        client = connect()
        try:
            conv, turns = None, []
            for turn in range(1, 7):
                before = reused() if reused is not None else None
                r = client.request(f"turn-{c}-{turn}", notes_message(turn + 10 * c, per_turn), params(answer),
                                   conversation_id=conv)
                if reused is not None:  # else the client's own figure, where it has one
                    after = reused()
                    r["reused_tokens"] = int(after - before) if after is not None and before is not None else None
                conv = r["conversation_id"]
                turns.append(r)
        finally:
            client.close()
        convs.append(turns)
    t1 = percentile([t[0]["ttfd_s"] for t in convs], 50)
    t6 = percentile([t[5]["ttfd_s"] for t in convs], 50)
    last = convs[-1]
    return {"conversations": len(convs), "ttfd_turn1_s": t1, "ttfd_turn6_s": t6, "ratio": t6 / t1,
            "turn1_prompt_tokens": last[0]["prompt_tokens"], "turn6_prompt_tokens": last[5]["prompt_tokens"],
            "turn6_reused_tokens": last[5].get("reused_tokens"),
            "turns": [{k: r.get(k) for k in ("ttfd_s", "prompt_tokens", "reused_tokens", "tokens")} for r in last]}
