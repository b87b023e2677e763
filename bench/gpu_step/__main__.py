"""``python -m bench.gpu_step [--full] [--device cpu --quick]``: bench/gpu_step/benchmark.py."""

import sys

from bench.gpu_step.benchmark import main

sys.exit(main())
