"""Conversations' KV on disk (chat/engine/kv/disk.py, CHAT_KV_DISK_MB): a turn after a restart continues from
it and answers as a warm turn does; a torn file is deleted and the turn prefilled; a deleted conversation's
file goes; the byte budget drops the oldest; another model never reads it."""
from __future__ import annotations

import time

import torch
from helpers import ask, collect, make_engine

from chat.engine import GenParams
from chat.engine.kv import disk as kvdisk

PARAMS = GenParams(temperature=0, max_new_tokens=24)
TURN1 = ask("Tell me about the sea, the wind and the long grey harbour walls.")


def turn2(first: str) -> list:
    return TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the boats?"}]


def start(tiny_model, folder, **overrides):
    return make_engine(tiny_model, folder / "data", cache_dir=str(folder / "cache"), **overrides)


def files(folder):
    return sorted((folder / "cache" / "kv").rglob("*.kv"))


def test_a_turn_after_a_restart_continues_from_the_kv_on_disk(tiny_model, tmp_path):
    warm = start(tiny_model, tmp_path / "warm", kv_disk_mb=0)  # memory only: the warm turn 2
    first = collect(warm.submit(TURN1, PARAMS, key="c1"))[0]
    expected, events = collect(warm.submit(turn2(first), PARAMS, key="c1"))
    warm.shutdown()
    reused = events[-1].reused_tokens
    assert reused > 0 and not files(tmp_path / "warm")

    engine = start(tiny_model, tmp_path)
    assert collect(engine.submit(TURN1, PARAMS, key="c1"))[0] == first
    engine.shutdown()  # the entry is on disk once the engine has stopped
    deadline = time.monotonic() + 30
    while not engine.closed:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert len(files(tmp_path)) == 1

    again = start(tiny_model, tmp_path)
    try:
        answer, events = collect(again.submit(turn2(first), PARAMS, key="c1"))
        # the first turn (prompt and answer) came from disk, as much of it as a warm turn 2 reuses from memory
        assert events[-1].reused_tokens == reused and answer == expected
        assert again.prefix.disk is not None and again.prefix.disk.reads == 1
    finally:
        again.shutdown()


def test_a_torn_file_is_deleted_and_the_turn_prefilled(tiny_model, tmp_path):
    engine = start(tiny_model, tmp_path)
    try:
        first, events = collect(engine.submit(TURN1, PARAMS, key="c2"))
        first_prompt = events[-1].usage["prompt_tokens"]
        engine.prefix.flush()
        [path] = files(tmp_path)
        path.write_bytes(path.read_bytes()[:1000])  # a write cut short by a crash, say
        engine.prefix.pop("c2")  # as after a restart: nothing in memory
        answer, events = collect(engine.submit(turn2(first), PARAMS, key="c2"))
        assert answer and events[-1].reason == "length"
        assert events[-1].reused_tokens < first_prompt  # at most the shared preamble: not the first turn
        engine.prefix.flush()
        [rewritten] = files(tmp_path)  # the turn's own entry replaced it
        ids, keys, values = engine.prefix.disk.load("c2")
        assert len(ids) > first_prompt and keys[0].shape[2] == values[-1].shape[2] == len(ids)
    finally:
        engine.shutdown()


def test_a_deleted_conversation_takes_its_kv_with_it(tiny_model, tmp_path):
    engine = start(tiny_model, tmp_path)
    try:
        collect(engine.submit(TURN1, PARAMS, key="gone"))
        collect(engine.submit(TURN1, PARAMS, key="kept"))
        engine.prefix.flush()
        assert len(files(tmp_path)) == 2
        engine.forget("gone")
        assert [f.name for f in files(tmp_path)] == [engine.prefix.disk.path("kept").name]
        deadline = time.monotonic() + 10
        while "gone" in engine.prefix.entries:  # the engine thread drops it from memory at its next turn
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "kept" in engine.prefix.entries
    finally:
        engine.shutdown()


def test_the_budget_drops_the_oldest_and_another_model_has_its_own_folder(tmp_path, monkeypatch):
    shape = (2, 1, 16)
    disk = kvdisk.DiskKV(tmp_path / "a", 10**9, shape, torch.bfloat16)

    def entry(n):
        return [torch.randn(1, 1, n, 16).bfloat16() for _ in range(2)]

    for i in range(5):
        disk.save(f"k{i}", list(range(10)), entry(10), entry(10))
        disk.flush()
        if i == 0:
            disk.budget = int(3.5 * disk.path("k0").stat().st_size)  # room for three entries
        time.sleep(0.01)  # distinct modification times
    kept = {p.name for p in (tmp_path / "a").glob("*.kv")}
    assert kept == {disk.path(f"k{i}").name for i in (2, 3, 4)}
    ids, keys, values = disk.load("k4")
    assert ids == list(range(10)) and keys[0].shape == (1, 1, 10, 16) and keys[0].dtype == torch.bfloat16
    # a conversation deleted while its entry waits to be written: never written
    monkeypatch.setattr(kvdisk, "PATIENCE_S", 0.5)
    disk.busy = lambda: True  # the engine running answers: the write waits for an idle moment
    disk.save("late", list(range(10)), entry(10), entry(10))
    disk.drop("late")
    disk.idle.set()
    disk.flush()
    assert not disk.path("late").exists()
    disk.busy = lambda: False
    other = kvdisk.DiskKV(tmp_path / "a", 10**9, (3, 1, 16), torch.bfloat16)  # another shape, same folder
    assert other.load("k4") is None and not other.path("k4").exists()  # unreadable as its own: deleted
    assert kvdisk.fingerprint("m", 1) != kvdisk.fingerprint("m", 2)
