import sys

from bench.size_trend.benchmark import main

sys.exit(main())
