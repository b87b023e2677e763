"""``python -m bench.transport [--full]``: bench/transport/benchmark.py."""

import sys

from bench.transport.benchmark import main

sys.exit(main())
