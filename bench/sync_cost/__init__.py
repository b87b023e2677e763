"""Sync cost: one NoLoCo pair exchange against one hivemind all-reduce among all N peers
of a stage, on the critical path. ``benchmark`` schedules the rounds and ``swarm`` steers
the ``peer`` processes (``ipc``: what they share), on loopback or in the network
namespaces of ``net``; ``report`` draws the plot and the BENCHMARKS.md section.

Run it with ``python -m bench.sync_cost [--full]``."""
