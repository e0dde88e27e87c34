"""Windowed layers in rings in the batch's KV buffer (chat/engine/kv/buffer.py ``rings``, the C++ step's slots): a
Gemma 3 batch decoded far past its windowed layers' rings (rows joining and leaving, a drafted step rolled back)
gives every step's logits bit for bit as the same batch in a buffer with every column, its rows taken out (the
prefix cache, the disk) are the same, and the windowed layers hold a ring's columns however long the answers."""
from __future__ import annotations

import torch
from test_native import FILES, library  # noqa: F401  (the library fixture)
from test_quant import on_thread
from tinygguf import tiny_gguf

from chat.engine.kernels import gguf
from chat.engine.kv.buffer import RING_SLACK, TRIM_SLACK, KVBuffer, joined
from chat.engine.model import native, weights

WINDOW = FILES["gemma3"]["window"]  # 4 on layers 1-5 of 6
RING = WINDOW - 1 + TRIM_SLACK + RING_SLACK


def _prefilled(decoder, ids: list[int]) -> KVBuffer:
    alone = decoder.cache(1, len(ids) + 4)
    alone.open(len(ids))
    decoder.forward(torch.tensor([ids]), alone, torch.arange(len(ids))[None], native=False)
    alone.advance(len(ids))
    return alone


def _step(decoder, kv: KVBuffer, tokens: list[int], positions: list[int]) -> torch.Tensor:
    kv.open(1)
    logits = decoder.forward(torch.tensor(tokens)[:, None], kv, torch.tensor(positions)[:, None])
    kv.advance(1)
    return logits


def test_a_batch_in_rings_decodes_bit_for_bit_as_with_every_column(library):  # noqa: F811
    def run():
        decoder = weights.from_gguf(gguf.read(tiny_gguf(**FILES["gemma3"])), "off")
        native.use(decoder)
        assert decoder.native
        vocab = decoder.shape.vocab
        prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 40, 17)]
        late = [(5 * i + 11) % vocab for i in range(130)]  # joins once the others are past their rings
        buffers, tails, seen = [], [], []
        for rings in (True, False):
            kv, rows = None, []
            for ids in prompts:
                kv = joined(kv, _prefilled(decoder, ids), [0], reads_padding=not rings)
                rows.append([ids[-1], len(ids) - 1])
            assert kv is not None
            assert (kv.keys[0].shape[2] == RING) == rings and kv.keys[5].shape[2] >= kv.length  # layer 6 global
            steps = []
            for step in range(160):
                if step == 100:
                    kv = joined(kv, _prefilled(decoder, late), [0], reads_padding=not rings)
                    rows.append([late[-1], len(late) - 1])
                if step == 120:  # the second row ends: the last takes its place
                    kv.remove_row(1)
                    rows[1] = rows.pop()
                logits = _step(decoder, kv, [t for t, _ in rows], [p + 1 for _, p in rows])
                steps.append(logits)
                for row, token in zip(rows, logits.argmax(-1).tolist()):
                    row[0], row[1] = token, row[1] + 1
            while kv.n > 1:
                kv.remove_row(kv.n - 1)
                rows.pop()
            # a drafted step of 9 columns, 3 kept, then single steps on
            token, position = rows[0]
            kv.open(9)
            drafted = decoder.verify(torch.tensor([[token] + [(token + j) % vocab for j in range(1, 9)]]), kv,
                                     torch.arange(position + 1, position + 10)[None])
            kv.advance(3)
            kv.close(6)
            token, position = int(drafted[2].argmax()), position + 3
            for _ in range(20):
                logits = _step(decoder, kv, [token], [position + 1])
                steps.append(logits)
                token, position = int(logits.argmax()), position + 1
            buffers.append(kv)
            tails.append(kv.row(0))
            seen.append((steps, drafted))
        return buffers, tails, seen
    (ring, full), (ring_row, full_row), (with_rings, without) = on_thread(run)
    assert len(with_rings[0]) == len(without[0]) == 180
    assert all(torch.equal(a, b) for a, b in zip(with_rings[0], without[0]))
    assert torch.equal(with_rings[1], without[1])
    assert ring.length > 2 * RING  # well past the rings, twice round
    for i in range(6):
        for got, want in zip(ring_row, full_row):
            assert torch.equal(got[i], want[i])  # what the prefix cache and the disk keep: the same columns
    assert [k.shape[2] for k in ring.keys] == [RING] * 5 + [full.keys[5].shape[2]]
    assert all(k.shape[2] >= ring.length for k in full.keys)


def test_rings_move_with_the_buffer_when_it_grows_and_when_a_long_row_joins():
    """Columns renumbered (the buffer reallocated, a row longer than the others pushing them right) keep their
    values: each column's slot turns with it."""
    keep = (WINDOW - 1 + TRIM_SLACK, 0)
    kv = KVBuffer(2, 1, 16, torch.float32, torch.device("cpu"), rows=1, capacity=8, keep=keep, rings=True)
    rows = []
    for length in (300, 40, 700):
        k = torch.arange(length, dtype=torch.float32)[None, None, :, None].expand(1, 1, length, 16) + 1000 * len(rows)
        kv.add_row([k[:, :, -keep[0]:].clone(), k.clone()], [k[:, :, -keep[0]:].clone() * 2, k.clone() * 2])
        rows.append(length)
    for r, length in enumerate(rows):
        keys, values = kv.row(r)
        want = torch.arange(max(0, length - keep[0]), length, dtype=torch.float32) + 1000 * r
        assert torch.equal(keys[0][0, 0, :, 0], want) and torch.equal(values[0][0, 0, :, 0], want * 2)
        assert keys[1].shape[2] == length
    assert kv.keys[0].shape[2] == RING


def test_the_engine_answers_with_rings_as_with_every_column(tmp_path, library, monkeypatch):  # noqa: F811
    """The engine on the C++ step: answers long enough to go round the windowed layers' rings (a window of 8: rings
    of 87 columns), sent together and alone, and the next turn going on from what a ring kept (the prefix cache),
    come out exactly as with every column in the batch's buffer."""
    from helpers import QUESTIONS, ask, collect, make_engine
    from test_architectures import TINY, _native, _stopped
    from test_native import SHARED

    from chat.engine import GenParams
    from chat.engine.kv import buffer
    path = tiny_gguf(**TINY["gemma3"][0])
    greedy = GenParams(temperature=0, max_new_tokens=110)
    seeded = GenParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=110)
    turn1 = ask(QUESTIONS[0])

    def run(name: str) -> tuple:
        cache = tmp_path / name / "cache"
        cache.mkdir(parents=True)
        (cache / "native").symlink_to(SHARED / "native", target_is_directory=True)
        engine = _native(make_engine(path, tmp_path / name / "data", dtype="bfloat16", native=True,
                                     cache_dir=str(cache)))
        try:
            assert engine.describe()["decode"] == "native"
            alone = [collect(engine.submit(ask(q), seeded))[0] for q in QUESTIONS]
            together = [collect(g)[0] for g in [engine.submit(ask(q), seeded) for q in QUESTIONS]]
            first, events = collect(engine.submit(turn1, greedy, key="c1"))
            assert events[-1].usage["completion_tokens"] == 110  # past the rings (a prompt of ~40 and 110 > 87)
            turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the boats?"}]
            warm, events = collect(engine.submit(turn2, greedy, key="c1"))
            return alone, together, first, warm, events[-1].reused_tokens
        finally:
            _stopped(engine)
    rings = run("rings")
    assert rings[0] == rings[1] and rings[4] > RING
    sizes = []
    init = buffer.KVBuffer.__init__
    monkeypatch.setattr(buffer.KVBuffer, "__init__",
                        lambda self, *a, rings=False, **k: sizes.append(rings) or init(self, *a, rings=False, **k))
    monkeypatch.setattr(buffer.KVBuffer, "use_rings", lambda self: sizes.append("use"))
    assert run("every column") == rings
    assert "use" in sizes or True in sizes  # the engine did ask for rings, here refused
