"""Benchmark: the check of a downloaded state against the other replicas
(bench/state_check/benchmark.py)."""
