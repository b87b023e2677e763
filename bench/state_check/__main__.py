"""``python -m bench.state_check [--full]``: bench/state_check/benchmark.py."""

import sys

from bench.state_check.benchmark import main

sys.exit(main())
