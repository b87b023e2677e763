"""``python -m bench.latency_model [--full]``: bench/latency_model/benchmark.py."""

import sys

from bench.latency_model.benchmark import main

sys.exit(main())
