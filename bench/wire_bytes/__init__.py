"""Benchmark 6: bytes on the wire per outer round and per token, for each method
(``benchmark``: the cost model and its check against a real run).

Run it with ``python -m bench.wire_bytes [--full]``."""
