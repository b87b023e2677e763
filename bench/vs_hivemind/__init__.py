"""Benchmark 5: this project against hivemind.Optimizer, the same model, peers and tokens.
``benchmark`` compares the two runs of ``runs``: the hivemind ``peer`` processes and a
``swarm-node local`` swarm (``swarm``); ``curves`` is the bookkeeping of their losses.

Run it with ``python -m bench.vs_hivemind [--full]``."""
