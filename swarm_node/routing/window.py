"""How many micro-batches stage 0 keeps in the pipeline: enough that its compute never
waits for an answer, and no more.

A micro-batch is out for the wait between its forward and its backward (encoding, the
hops there and back, the later stages' compute, decoding); stage 0 computes for
``compute_s`` per micro-batch (forward plus backward). To keep its compute busy it needs
``(compute_s + wait_s) / compute_s`` in flight (Little's law), one more for the
variation of both, and never fewer than ``MIN_WINDOW``. On a GPU a small stage computes
in milliseconds while a hop takes tens of them, so the depth a fixed window of 4 gave
was the bottleneck; on a CPU two or three do, and every one more than needed is a
micro-batch whose backward sees weights a step newer than its forward did (the
recompute of ARCHITECTURE.md keeps that correct, not free).

The wait used is the least of the recent ones, not their mean: a wait that grows because
the next stage queues our own micro-batches must not make us send more of them
(BBR's reasoning for its minimum round trip). The window never exceeds the node's
``max_in_flight`` nor what the next stage's peers accept from one caller at once (4
each: a fifth is answered busy; routing/chooser.py sends a peer no more than that).
Until both times are measured it is ``MIN_WINDOW``."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_WINDOW = 2
RECENT = 32  # micro-batches whose times count


@dataclass
class InFlightWindow:
    max_in_flight: int
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")

    def note(self, compute_s: float, wait_s: float) -> None:
        """One micro-batch done: its forward plus backward at this stage, and how long it
        waited for its gradient in between."""
        if compute_s > 0 and wait_s >= 0:
            self.compute_s.append(compute_s)
            self.wait_s.append(wait_s)

    def size(self, next_stage_accepts: int) -> int:
        """Micro-batches to keep in flight; ``next_stage_accepts``: how many the next
        stage's live peers take from us at once (their count times each one's cap)."""
        cap = max(1, min(self.max_in_flight, next_stage_accepts))
        if not self.compute_s:
            return min(MIN_WINDOW, cap)
        compute_s = statistics.median(self.compute_s)
        needed = math.ceil((compute_s + min(self.wait_s)) / compute_s) + 1
        return max(min(MIN_WINDOW, cap), min(needed, cap))
