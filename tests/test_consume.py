"""``Generation.consume``: events a greenlet of the consumer's thread emits are handled in that
greenlet, without waking the consumer; order and errors are kept whoever handles them."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from helpers import ROOT

SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import json
    import gevent
    from chat.concurrency import start_real_thread
    from chat.engine.base import Generation, GenParams
    from chat.engine.events import Delta, Done

    def consume(gen, fail_on=None, slow_on=None):
        consumer, seen = gevent.getcurrent(), []
        def handle(event):
            seen.append([getattr(event, "text", "done"), "consumer" if gevent.getcurrent() is consumer else "emitter"])
            if seen[-1][0] == slow_on:
                gevent.sleep(0.2)
            if seen[-1][0] == fail_on:
                raise ValueError("handler failed on " + fail_on)
        try:
            gen.consume(handle)
        except ValueError as exc:
            seen.append(["raised", str(exc)])
        return seen

    def greenlet_producer(gen, texts, log):
        for text in texts:
            gevent.sleep(0.01)
            gen.emit(Delta(text))
        gen.emit(Done("stop"))
        log.append("producer finished")

    out = {}
    gen, log = Generation([], GenParams()), []
    gevent.spawn(greenlet_producer, gen, ["a", "b", "c"], log)
    out["same thread"] = consume(gen) + log

    gen, log = Generation([], GenParams()), []
    gevent.spawn(greenlet_producer, gen, ["a", "b", "c"], log)
    out["handler raises"] = consume(gen, fail_on="b")
    gevent.sleep(0.1)
    out["handler raises"] += log

    # "a" comes from another OS thread; while the consumer is busy with it, a greenlet emits
    # "b" and "c" (they queue behind it); "d" arrives once the consumer waits again.
    gen = Generation([], GenParams())
    def other_thread():
        gen.emit(Delta("a"))
    def late():
        gevent.sleep(0.05)
        gen.emit(Delta("b"))
        gen.emit(Delta("c"))
        gevent.sleep(0.4)
        gen.emit(Delta("d"))
        gen.emit(Done("stop"))
    start_real_thread(other_thread)
    gevent.spawn(late)
    out["mixed"] = consume(gen, slow_on="a")

    gen = Generation([], GenParams())
    def thread_producer():
        for text in ("a", "b"):
            gen.emit(Delta(text))
        gen.emit(Done("stop"))
    start_real_thread(thread_producer)
    out["other thread"] = consume(gen)
    print(json.dumps(out))
""")


def run_script() -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_consume_handles_each_event_where_it_is_emitted_and_keeps_order_and_errors():
    out = run_script()
    # A greenlet of this thread (the remote engine): handled in the emitting greenlet.
    assert out["same thread"] == [["a", "emitter"], ["b", "emitter"], ["c", "emitter"], ["done", "emitter"],
                                  "producer finished"]
    # A handler's error surfaces from consume(), in the consumer; the producer goes on unharmed.
    assert out["handler raises"] == [["a", "emitter"], ["b", "emitter"], ["raised", "handler failed on b"],
                                     "producer finished"]
    # Events emitted while a handler is busy queue behind it, in order.
    assert out["mixed"] == [["a", "consumer"], ["b", "consumer"], ["c", "consumer"], ["d", "emitter"],
                            ["done", "emitter"]]
    # Another OS thread (the local engine) never runs web code: the consumer handles everything.
    assert out["other thread"] == [["a", "consumer"], ["b", "consumer"], ["done", "consumer"]]
