"""Benchmarks (issue 6): one package per comparison, ``bench/<name>/`` run as
``python -m bench.<name> [--full]``, each writing bench/results/<name>.json and PNG plots;
what more than one of them uses lives in ``bench/common/``. `make bench` runs the quick
version of all of them."""
