"""Pairing for NoLoCo outer rounds."""
