"""``python -m bench.gpu_volunteer [--full]``: bench/gpu_volunteer/benchmark.py."""

import sys

from bench.gpu_volunteer.benchmark import main

sys.exit(main())
