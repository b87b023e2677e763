"""Benchmark: does NoLoCo keep up with DiLoCo as the model grows (issue 36)."""
