"""``python -m bench.scale [--full]``: bench/scale/benchmark.py."""

import sys

from bench.scale.benchmark import main

sys.exit(main())
