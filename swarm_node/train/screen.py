"""Screening what peers send by magnitude: a value (a norm, an RMS) is accepted when it
is at most ``max_ratio`` times the median of the recent values offered. Pure
bookkeeping; the caller decides what a rejection costs the sender.

What this defends against: activations or gradients wildly out of scale (exploding
activations, a broken GPU, a crude attacker) arriving among values of the usual scale.
The reference is the median of every value offered, refused ones included: honest
training moves the scale (early in training by orders of magnitude, and single honest
micro-batches come far above the median of the moment), and a reference fed only
accepted values goes stale and refuses an honest peer's every micro-batch for good. A
sustained shift is followed once it fills half the window; a sender that wants its
values accepted must make up half of what we see, and what it gets through is then
bounded by the stage's norms and gradient clipping. Partners' outer updates are held
to a scale fed only our own Deltas, and clipped (gossip/partner_check.py)."""

from __future__ import annotations

import math
import statistics
from collections import deque


class MagnitudeScreen:
    def __init__(self, max_ratio: float, window: int = 32, min_history: int = 1):
        if max_ratio <= 1:
            raise ValueError("max_ratio must be > 1")
        self.max_ratio = max_ratio
        self.min_history = min_history
        self._accepted: deque[float] = deque(maxlen=window)  # every finite value offered, newest last

    def note(self, value: float) -> None:
        """A value known to be good (e.g. this node's own), used as reference."""
        if math.isfinite(value) and value >= 0:
            self._accepted.append(value)

    def reference(self) -> float | None:
        if len(self._accepted) < self.min_history:
            return None
        return statistics.median(self._accepted)

    def check(self, value: float, what: str) -> str | None:
        """None when acceptable, else why not; a finite value joins the reference either way."""
        problem = self.check_only(value, what)
        if math.isfinite(value):
            self._accepted.append(value)
        return problem

    def check_only(self, value: float, what: str) -> str | None:
        """Like check, but the value does not join the reference."""
        if not math.isfinite(value):
            return f"{what} is not finite"
        reference = self.reference()
        if reference is not None and reference > 0 and value > self.max_ratio * reference:
            return f"{what} {value:.3g} is {value / reference:.0f}x the recent median {reference:.3g}"
        return None
