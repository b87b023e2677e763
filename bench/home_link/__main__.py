"""``python -m bench.home_link [--full]``: bench/home_link/benchmark.py."""

import sys

from bench.home_link.benchmark import main

sys.exit(main())
