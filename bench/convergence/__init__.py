"""Benchmark 4: NoLoCo vs DiLoCo vs DDP vs local-only training at equal tokens.
``benchmark`` trains and renders, ``stats`` is the arithmetic and the checks.

Run it with ``python -m bench.convergence [--full]``."""
