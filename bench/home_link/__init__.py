"""Benchmark: volunteers on shaped home links (bench/home_link/benchmark.py)."""
