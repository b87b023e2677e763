"""``python -m bench.vs_hivemind [--full]``: bench/vs_hivemind/benchmark.py."""

import sys

from bench.vs_hivemind.benchmark import main

sys.exit(main())
