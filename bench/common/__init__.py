"""What more than one benchmark uses: the result files and plots (``results``), a
network-namespace sandbox that counts a swarm's bytes (``sandbox``), and child
processes that are always stopped (``procs``)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository: benchmarks start their children here, so ``-m bench.…`` finds them."""
