"""Benchmark of the chat server against the real bundled model: ``python -m bench.run``."""
