"""Benchmark 3: tokens/s of a local swarm against plain single-process training.
``benchmark`` runs both, ``probe`` instruments the swarm's nodes and samples their CPU
time, ``analysis`` is the arithmetic.

Run it with ``python -m bench.swarm_efficiency [--full]``."""
