"""The hand-off between submitters and the engine thread under a storm of submits and cancels."""
from __future__ import annotations

import random
import sys
import threading

from helpers import ask, in_threads, make_engine

from chat.engine import Delta, Done, GenParams


def last_reason(gen) -> str:
    """The ``done`` reason, or "lost" when the engine dropped the generation (a guard, not a timing)."""
    while True:
        event = gen.next_event(120)
        if event is None:
            return "lost"
        if isinstance(event, Done):
            return event.reason


def test_submits_and_cancels_from_many_threads_never_end_a_row_with_error(tiny_model, tmp_path):
    """Producers append while the engine scans its waiters: no row may end with reason ``error``."""
    eng = make_engine(tiny_model, tmp_path, max_batch=2, max_queue=10_000)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so any unguarded scan is interleaved
    gens, lock = [], threading.Lock()
    try:
        running = eng.submit(ask("keep the batch busy"), GenParams(temperature=0, max_new_tokens=4000))
        next(e for e in running if isinstance(e, Delta))

        def storm(i: int) -> None:
            rng = random.Random(i)
            mine = []
            for j in range(60):
                gen = eng.submit([{"role": "user", "content": f"q{i}-{j}"}],
                                 GenParams(temperature=0.8, max_new_tokens=3, seed=j))
                mine.append(gen)
                if rng.random() < 0.6:
                    rng.choice(mine).cancel()
            with lock:
                gens.extend(mine)

        in_threads(storm, 8)
        running.cancel()
        reasons = [last_reason(gen) for gen in gens + [running]]
    finally:
        sys.setswitchinterval(old_interval)
        eng.shutdown()
    assert len(reasons) == 8 * 60 + 1
    assert "error" not in reasons and "lost" not in reasons
    assert set(reasons) <= {"cancelled", "length", "stop"}
