"""Searches off the event loop: their own threads, a budget the client's answer keeps to even when
the database cannot be interrupted, and a bound on how many run at once (per worker, per address)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import ROOT

from chat.errors import ProtocolError
from chat.searches import MAX_PER_ADDRESS, MAX_SEARCHES, Searches

# Under gevent: a search stuck in the database for 5 s is answered SearchTimeout at its budget,
# while a greenlet keeps ticking (the loop is free), and its slot is taken until the thread ends.
SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import time
    import gevent
    from chat.concurrency import real_sleep
    from chat.errors import SearchTimeout
    from chat.searches import Searches

    class Stuck:
        def search(self, client, text, deadline):
            real_sleep(2.0)  # an uninterruptible step, past any deadline
            return []

    ticks = []
    def tick():
        while True:
            ticks.append(time.monotonic())
            gevent.sleep(0.01)
    gevent.spawn(tick)
    searches = Searches(0.3)
    t0 = time.monotonic()
    try:
        searches.run(Stuck(), "alice", "198.51.100.1", "alpha")
    except SearchTimeout:
        print("timeout", round(time.monotonic() - t0, 2))
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    print("max gap", round(max(gaps), 3))
    print("held", searches.running)
    real_sleep(2.0)
    gevent.sleep(0.1)
    print("freed", searches.running)
""")


def test_a_search_that_overruns_is_answered_at_its_budget_and_never_blocks_the_loop():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "timeout" in lines, out.stdout + out.stderr
    assert float(lines["timeout"]) < 1.5  # budget 0.3 s + 0.25 s grace, on a loaded machine
    assert float(lines["max"].split()[-1]) < 0.25  # the loop kept running meanwhile
    assert lines["held"] == "{'198.51.100.1': 1}" and lines["freed"] == "{}"


class Blocking:
    """A store whose searches wait until released."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def search(self, client, text, deadline):
        self.entered.release()
        self.release.wait(30)
        return [{"text": text}]


def test_searches_at_once_are_bounded_per_address_and_per_worker():
    store, searches = Blocking(), Searches(30)
    results, threads = [], []

    def run(address):
        results.append(searches.run(store, "c", address, address))

    addresses = ["198.51.100.1"] * MAX_PER_ADDRESS + [f"203.0.113.{i}" for i in range(MAX_SEARCHES - MAX_PER_ADDRESS)]
    for address in addresses:
        threads.append(threading.Thread(target=run, args=(address,)))
        threads[-1].start()
    for _ in addresses:
        assert store.entered.acquire(timeout=10)
    for address in ("198.51.100.1", "192.0.2.99"):  # the address's share, then the worker's, is taken
        with pytest.raises(ProtocolError) as refused:
            searches.run(store, "c", address, "x")
        assert refused.value.code == "overloaded"
    store.release.set()
    for thread in threads:
        thread.join(10)
    assert len(results) == len(addresses) and searches.running == {}
    assert searches.run(store, "c", "198.51.100.1", "again") == [{"text": "again"}]
