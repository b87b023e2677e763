"""``python -m bench.sync_cost [--full]``: bench/sync_cost/benchmark.py."""

import sys

from bench.sync_cost.benchmark import main

sys.exit(main())
