"""How much a cumulative counter grew over the last minute: what a node tells the swarm
about its progress, so a dashboard can tell a node that trains from one that is stuck."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

RECENT_WINDOW_S = 60.0


class RecentGrowth:
    def __init__(self, window_s: float = RECENT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque()  # (time, counter), oldest first

    def sample(self, value: int) -> int:
        """Record the counter's current ``value``; returns its growth over the window (or
        since the first sample, when that is more recent)."""
        return self.sample_rate(value)[0]

    def sample_rate(self, value: int) -> tuple[int, float]:
        """``sample``'s growth and the seconds it covers."""
        now = self.clock()
        self._samples.append((now, value))
        # keep one sample at or before the window's start, as the baseline
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        first_s, first = self._samples[0]
        return value - first, now - first_s
