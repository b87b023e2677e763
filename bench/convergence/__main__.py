"""``python -m bench.convergence [--full]``: bench/convergence/benchmark.py."""

import sys

from bench.convergence.benchmark import main

sys.exit(main())
