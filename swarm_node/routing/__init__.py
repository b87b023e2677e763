"""Choosing the next-stage peer for a micro-batch."""
