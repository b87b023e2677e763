"""Benchmarks (issue 6): one script per comparison, each writing bench/results/<name>.json
and PNG plots. `make bench` runs the quick version of all of them."""
