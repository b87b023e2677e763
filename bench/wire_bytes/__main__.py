"""``python -m bench.wire_bytes [--full]``: bench/wire_bytes/benchmark.py."""

import sys

from bench.wire_bytes.benchmark import main

sys.exit(main())
