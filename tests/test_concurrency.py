"""``run_in_thread``: CPU work off the gevent loop, so other greenlets run while it does."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

# The work waits for a lock that only another greenlet releases: if it ran on the event loop,
# that greenlet could never run and the wait would end by its (deadlock-guard) timeout instead.
SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import gevent
    from chat.concurrency import real_lock, run_in_thread

    lock = real_lock()
    lock.acquire()
    gevent.spawn(lock.release)
    print("acquired" if run_in_thread(lock.acquire, True, 30) else "loop was blocked")

    def boom():
        raise ValueError("from the thread")
    try:
        run_in_thread(boom)
    except ValueError as exc:
        print("raised", exc)
""")


def test_run_in_thread_leaves_the_gevent_loop_free_and_passes_errors_back():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["acquired", "raised from the thread"], out.stderr


def test_submit_fits_the_prompt_through_run_in_thread(tiny_model, tmp_path, monkeypatch):
    from helpers import ask, collect, make_engine

    from chat.engine import GenParams
    from chat.engine.core import local

    calls = []

    def recording(fn, *args):
        calls.append(fn.__name__)
        return fn(*args)

    monkeypatch.setattr(local, "run_in_thread", recording)
    eng = make_engine(tiny_model, tmp_path)
    try:
        collect(eng.submit(ask("hello"), GenParams(temperature=0, max_new_tokens=3)))
    finally:
        eng.shutdown()
    assert calls == ["prepare"]  # fit the prompt and compile its grammar, if any
