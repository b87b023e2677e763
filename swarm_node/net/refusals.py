"""What a node refused of other peers, counted by reason: a fixed vocabulary, so the
status JSON and the Prometheus counter stay bounded whatever peers send (no per-peer
keys). Counted where the refusal is decided: net/guard.py for what a peer sent or how
its calls went, net/transport.py for the streams the server caps turn away."""

from __future__ import annotations

# reason -> what it counts (docs/PROTOCOL.md 2.2)
REASONS: dict[str, str] = {
    "malformed": "a request or answer that does not parse or does not fit its protocol",
    "oversize": "a frame longer than its protocol's cap",
    "stalled": "a caller that did not send its request in time",
    "busy": "a caller turned away at the stream caps (no fault of its own)",
    "not-admitted": "a caller not on a closed run's list, or banned: its stream closed unread",
    "banned": "a caller banned for repeated faults (once a ban)",
    "failed": "a call to a peer that failed: timed out, broke off, or answered garbage",
    "rounds-apart": "a partner declined again and again for being rounds apart",
    "poisoned": "an update held out of scale: the partner is kept off",
    "bad-state": "a downloaded state the stage's other replicas disown",
    "bad-data": "a data request or answer that is malformed or not what the manifest holds",
    "bad-record": "a registry record we cannot use (unparseable, another run's, not admitted)",
}


class Refusals:
    """Counts by reason; an unknown reason is a bug (the vocabulary is fixed)."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(REASONS, 0)

    def count(self, reason: str) -> None:
        if reason not in self._counts:
            raise ValueError(f"unknown refusal reason {reason!r}; one of {', '.join(REASONS)}")
        self._counts[reason] += 1

    def get(self, reason: str) -> int:
        return self._counts[reason]

    def as_dict(self) -> dict[str, int]:
        """Every reason, zeros included: a counter that appears only once it is non-zero
        makes Prometheus rates miss its first increment."""
        return dict(self._counts)
