"""Quality of the quantized path against dense weights: greedy answers and perplexity.

Run as ``python -m bench.quality``; prints one JSON object. The model is the server's (``CHAT_MODEL``,
default the bundled GGUF), loaded three times: ``CHAT_QUANT=auto`` (after the idle chores, as the
server runs it), ``CHAT_QUANT=off`` and dense in float32 (the noise floor: the same exact weights, other
rounding). For each short question both answer greedily (the engine's
own decoder, no sampling); an answer is right when it contains one of the expected words (50
short questions a 135M model gets about two thirds of). The
perplexity of a fixed text is taken token by token through decode steps, where the int4 weights
are used.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import threading

QUESTIONS = [
    ("What is the capital of France?", ["Paris"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("What is the capital of Spain?", ["Madrid"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("What planet is known as the Red Planet?", ["Mars"]),
    ("What is the chemical symbol for water?", ["H2O", "H₂O"]),
    ("How many days are in a week?", ["seven", "7"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What color is the sky on a clear day?", ["blue"]),
    ("What is the freezing point of water in Celsius?", ["0", "zero"]),
    ("Who wrote Romeo and Juliet?", ["Shakespeare"]),
    ("What is 2 plus 2?", ["4", "four"]),
    ("What language is spoken in Brazil?", ["Portuguese"]),
    ("What is the opposite of hot?", ["cold"]),
    ("Which animal is known as the king of the jungle?", ["lion"]),
    ("What gas do plants take in from the air?", ["carbon dioxide", "CO2"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("How many continents are there?", ["seven", "7"]),
    ("What is the capital of the United Kingdom?", ["London"]),
    ("What is the capital of Russia?", ["Moscow"]),
    ("What is the capital of China?", ["Beijing"]),
    ("What is the capital of Egypt?", ["Cairo"]),
    ("What is the capital of Canada?", ["Ottawa"]),
    ("What is the largest ocean on Earth?", ["Pacific"]),
    ("What is the closest star to Earth?", ["Sun"]),
    ("What do bees make?", ["honey"]),
    ("What is the boiling point of water in Celsius?", ["100"]),
    ("How many hours are in a day?", ["24", "twenty-four"]),
    ("How many minutes are in an hour?", ["60", "sixty"]),
    ("What is 10 times 10?", ["100", "hundred"]),
    ("What is 5 plus 3?", ["8", "eight"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
    ("Who was the first president of the United States?", ["Washington"]),
    ("What is the largest mammal?", ["whale"]),
    ("What is the main language spoken in Mexico?", ["Spanish"]),
    ("What is the currency of Japan?", ["yen"]),
    ("What is frozen water called?", ["ice"]),
    ("Which organ pumps blood through the body?", ["heart"]),
    ("What do cows drink?", ["water"]),
    ("What is the opposite of day?", ["night"]),
    ("How many sides does a triangle have?", ["three", "3"]),
    ("What color are bananas when they are ripe?", ["yellow"]),
    ("What is the largest country by area?", ["Russia"]),
    ("Which planet do we live on?", ["Earth"]),
    ("What is the primary gas in the air we breathe?", ["nitrogen"]),
    ("What is the capital of Australia?", ["Canberra"]),
    ("How many months are in a year?", ["twelve", "12"]),
    ("What animal says moo?", ["cow"]),
]

TEXT = (
    "The history of bread goes back at least thirty thousand years. The first breads were flat, made from "
    "crushed grains and water and cooked on hot stones. When people began to farm wheat and barley, bread "
    "became a daily food. In ancient Egypt bakers learned that dough left to stand would rise, because wild "
    "yeasts from the air fed on it and filled it with small bubbles of gas. Leavened bread spread around the "
    "Mediterranean, and the Romans built large public bakeries with stone ovens and mills turned by animals. "
    "For centuries the colour of a loaf showed the wealth of the people who ate it: white bread, made from "
    "finely sifted flour, was for the rich, while the poor ate dark bread of rye or barley. The industrial "
    "age brought roller mills and, later, sliced bread wrapped in paper, and today bakers around the world "
    "are returning to slow fermentation and whole grains."
)


def _answers(torch, loaded, steps: int) -> list[str]:
    from bench.inprocess import decoder_steps
    from chat.engine.core import prompt

    out = []
    for question, _ in QUESTIONS:
        ids = prompt.render(loaded.tokenizer, [{"role": "user", "content": question}])
        tokens = decoder_steps(torch, loaded, ids, 1, steps)
        end = next((i for i, t in enumerate(tokens) if t in loaded.eos_ids), len(tokens))
        out.append(loaded.tokenizer.decode(tokens[:end], skip_special_tokens=True).strip())
    return out


def _perplexity(torch, loaded) -> float:
    ids = loaded.tokenizer.encode(TEXT)
    decoder = loaded.decoder
    kv = decoder.cache(1, len(ids) + 8)
    total = 0.0
    for i in range(len(ids) - 1):
        kv.reserve(1)
        kv.mask[0, kv.length] = 1
        logits = decoder(torch.tensor([[ids[i]]]), kv, torch.tensor([[i]]))
        kv.length += 1
        total -= float(torch.log_softmax(logits[0], dim=-1)[ids[i + 1]])
    return math.exp(total / (len(ids) - 1))


def measure(steps: int) -> dict:
    import torch

    from chat.config import Settings
    from chat.engine.model import loader

    base = Settings.from_env()
    result: dict = {"questions": [q for q, _ in QUESTIONS]}
    with torch.inference_mode():
        # "float32": dense again, in float32 arithmetic: how far two exact-weight paths' greedy answers
        # part by rounding alone (the questions' noise floor)
        for mode in ("auto", "off", "float32"):
            settings = dataclasses.replace(base, quant="off", dtype="float32") if mode == "float32" else \
                dataclasses.replace(base, quant=mode)
            loaded = loader.load(settings)
            if loaded.decoder is None:
                raise SystemExit("the model does not run on the own decoder: nothing to compare")
            for _ in loader.finish(loaded, settings):
                pass
            answers = _answers(torch, loaded, steps)
            right = [any(w.lower() in a.lower() for w in words) for a, (_, words) in zip(answers, QUESTIONS)]
            result[mode] = {"weights": loaded.weights, "answers": answers, "right": sum(right),
                            "perplexity": _perplexity(torch, loaded)}
    q, d, f = result["auto"], result["off"], result["float32"]
    same = sum(a == b for a, b in zip(q["answers"], d["answers"]))
    prefix = [len(_common(a, b)) / max(len(b), 1) for a, b in zip(q["answers"], d["answers"])]
    result["summary"] = {
        "right": f"{q['right']} / {d['right']} / {f['right']} of {len(QUESTIONS)} (quantized / dense / dense float32)",
        "dense_identical": sum(a == b for a, b in zip(d["answers"], f["answers"])),
        "identical": same, "mean_shared_prefix": sum(prefix) / len(prefix),
        "perplexity": [q["perplexity"], d["perplexity"]], "perplexity_ratio": q["perplexity"] / d["perplexity"]}
    return result


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per answer")
    args = parser.parse_args()
    result: dict = {}
    # torch stays off the main thread, as in the server.
    worker = threading.Thread(target=lambda: result.update(measure(args.tokens)), name="bench-quality")
    worker.start()
    worker.join()
    print(json.dumps(result, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
