"""Prometheus metrics for one app (its own registry, so tests may build many apps).

With several gunicorn workers (gunicorn.conf.py sets PROMETHEUS_MULTIPROC_DIR), every
worker writes its values to files in that folder and ``/metrics`` on any worker
reports the sum over all live workers; gauges read from the engine are then
refreshed every second instead of at scrape time.
"""
from __future__ import annotations

import gc
import os
import time

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for web/health.py's /metrics)

from .concurrency import spawn

if TYPE_CHECKING:
    from .engine import Done, Engine

REFRESH_S = 1.0
SLOW_REFRESH_S = 30.0  # counting greenlets walks every object: not every second in every worker


def multiprocess() -> bool:
    """Whether this process shares its metrics with sibling workers through files."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 250, 500)


class Metrics:
    """The server's counters, gauges and histograms."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.multiprocess = multiprocess()
        total: dict[str, Any] = {"multiprocess_mode": "livesum"}  # summed over live workers (in multiprocess mode)
        self.connections = Gauge("chat_ws_connections", "Open WebSocket connections", registry=r, **total)
        self.probes = [  # gauges read from the engine and the process
            (Gauge("chat_active_generations", "Generations running in the engine", registry=r, **total),
             lambda: engine.stats().get("active", 0)),
            (Gauge("chat_queue_depth", "Generations waiting for engine capacity", registry=r, **total),
             lambda: engine.stats().get("queued", 0)),
            (Gauge("chat_draft_steps", "Steps that checked drafted tokens (CHAT_DRAFT)", registry=r, **total),
             lambda: engine.stats().get("draft_steps", 0)),
            (Gauge("chat_draft_accepted_tokens", "Drafted tokens the answers made as drafted", registry=r, **total),
             lambda: engine.stats().get("draft_accepted_tokens", 0)),
            (Gauge("chat_ready", "1 once the model is loaded and warmed up (every worker's)", registry=r,
                   multiprocess_mode="livemin"), lambda: 1 if engine.ready else 0),
            (Gauge("chat_os_threads", "OS threads in the worker processes", registry=r, **total), _os_threads),
        ]
        self.slow_probes = [
            (Gauge("chat_greenlets", "Live greenlets in the worker processes", registry=r, **total), _greenlets),
        ]
        if self.multiprocess:
            spawn(self._refresh_forever)
        else:
            ProcessCollector(registry=r)  # resident memory, CPU, open fds (of this one process)
            for gauge, probe in self.probes + self.slow_probes:
                gauge.set_function(probe)
        self.tokens = Counter("chat_tokens_generated", "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("chat_prompt_tokens", "Prompt tokens processed", registry=r)
        self.reused_tokens = Counter("chat_prompt_tokens_reused",
                                     "Prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.generations = Counter("chat_generations", "Finished generations by done reason",
                                   ["reason"], registry=r)
        self.cancellations = Counter("chat_cancellations", "Generations cancelled by clients or disconnects",
                                     registry=r)
        self.errors = Counter("chat_errors", "Protocol errors sent, by code", ["code"], registry=r)
        self.ttft = Histogram("chat_time_to_first_delta_seconds", "Time from request to first delta",
                              buckets=TTFT_BUCKETS, registry=r)
        self.rate = Histogram("chat_tokens_per_second", "Decode speed per generation",
                              buckets=RATE_BUCKETS, registry=r)
        self.weights = Gauge("chat_model_weights", "1 for the weight format the local model's decode step uses "
                             "(int4, bfloat16, float32)", ["weights"], registry=r, multiprocess_mode="livemax")
        self.cpu = Gauge("chat_cpu_class", "1 for the CPU class the local engine runs (avx512_bf16, avx512, avx2, "
                         "generic)", ["cpu"], registry=r, multiprocess_mode="livemax")

    def finished(self, done: Done) -> None:
        """Record one ``Done`` event."""
        self.generations.labels(done.reason).inc()
        if done.reason == "cancelled":
            self.cancellations.inc()
        self.tokens.inc(done.usage.get("completion_tokens") or 0)
        self.prompt_tokens.inc(done.usage.get("prompt_tokens") or 0)
        self.reused_tokens.inc(done.reused_tokens)
        if done.timings.get("ttft_ms") is not None:
            self.ttft.observe(done.timings["ttft_ms"] / 1000)
        if done.timings.get("tokens_per_s"):
            self.rate.observe(done.timings["tokens_per_s"])

    def render(self) -> bytes:
        facts = self.engine.describe() if self.engine.ready else {}
        if facts.get("weights"):  # one label: the weights may move (onto the block products, once built)
            self.weights.clear()
            self.weights.labels(facts["weights"]).set(1)
        if facts.get("cpu"):
            self.cpu.labels(facts["cpu"]).set(1)
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess as mp
        self._refresh(self.probes + self.slow_probes)
        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
        return generate_latest(registry)

    def _refresh(self, probes: list | None = None) -> None:
        for gauge, probe in self.probes if probes is None else probes:
            gauge.set(probe())

    def _refresh_forever(self) -> None:
        slow_due = 0.0
        while True:
            try:
                self._refresh()
                if time.monotonic() >= slow_due:
                    slow_due = time.monotonic() + SLOW_REFRESH_S
                    self._refresh(self.slow_probes)
            except Exception:  # a probe failing once must not stop the others for good
                pass
            time.sleep(REFRESH_S)


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _greenlets() -> int:
    try:
        from greenlet import greenlet
    except ImportError:
        return 0
    # type(), not isinstance(): isinstance falls back to ``__class__``, which raises on a dead
    # weakref proxy or a context-bound werkzeug LocalProxy and would turn /metrics into a 500
    return sum(1 for o in gc.get_objects() if issubclass(type(o), greenlet) and not o.dead)
