"""Benchmark 2: the NoLoCo paper's latency model at N up to 1024 (``sim``), fed with the
times other benchmarks measured (``inputs``); ``benchmark`` runs it, ``report`` draws it.

Run it with ``python -m bench.latency_model [--full]``."""
