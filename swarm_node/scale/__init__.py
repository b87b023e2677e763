"""The swarm-scale simulator: the node's own protocol code (pairing, the outer
exchange and its partner checks, the peer guard, the peer chooser, the membership view
and the registry) for hundreds of peers a stage, in one process on a virtual clock,
with no model compute. Links, step times, churn and the DHT are modelled
(scale/world.py says how); everything that decides what a peer does is the real code.

    python -m swarm_node.scale --peers 256            # one run, figures on stdout
    python -m bench.scale                              # the sweep over N, BENCHMARKS.md
"""
