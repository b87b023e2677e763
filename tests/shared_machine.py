"""What every multi-process test adds to its nodes' command lines.

A node on the debug model trains as fast as the CPU lets it, and four of them take
whatever the machine has: the other test worker's tests (and whatever else the machine
runs) wait behind them, and the suite misses its time on a busy 2-core machine. These
tests check the protocol, not the speed, so their nodes compute a quarter of the time,
as a volunteer who shares the machine would run one (``--compute-share``). Each node's
messages slow with its compute, so the whole swarm's appetite falls with it: measured on
this machine beside a one-core CPU hog, the default tier took 434 s of tests instead of
615 s. Benchmarks run nodes at their full share."""

COMPUTE_SHARE = ("--compute-share", "0.25")
