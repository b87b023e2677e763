"""``python -m bench.boundary_codec [--full]``: bench/boundary_codec/benchmark.py."""

import sys

from bench.boundary_codec.benchmark import main

sys.exit(main())
