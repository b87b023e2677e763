"""``python -m bench.swarm_efficiency [--full]``: bench/swarm_efficiency/benchmark.py."""

import sys

from bench.swarm_efficiency.benchmark import main

sys.exit(main())
