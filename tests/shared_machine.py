"""What a multi-process test adds to the command line of nodes that train on while it
waits for something else.

A node on the debug model trains as fast as the CPU lets it. Where a test waits on
something other than training steps (a bootstrap's restart, a newcomer's start, a
browser, a NAT), its nodes' free-running steps are work nobody needs, and the other
test worker's tests (and whatever else the machine runs) wait behind them. Such nodes
compute a quarter of the time, as a volunteer who shares the machine would run one
(``--compute-share``); each node's messages slow with its compute, so the swarm's
appetite falls with it. Measured on this machine beside a one-core CPU hog, with every
multi-process test's nodes at 0.25: 470 s of tests instead of 615 s.

Tests bounded by steps (a swarm given --max-steps, a wait for inner step N) do not use
it: their nodes do the same work either way, and resting only stretches it (the local
swarm's 90 steps took 125 s instead of 38 on an idle machine). Benchmarks run nodes at
their full share."""

COMPUTE_SHARE = ("--compute-share", "0.25")
