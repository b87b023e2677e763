"""How many micro-batches stage 0 keeps in the pipeline: enough that its compute never
waits for an answer, no more than its link moves in good time, and how long each may
take before it counts as lost.

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
Until both times are measured it is ``MIN_WINDOW``.

On a slow link the link, not the compute, sets the pace, and micro-batches beyond what
it moves only queue behind each other on it, and each one more takes a share of the
uplink from the outer payloads (paced flows share it alike). So the window is also held
to the link's bandwidth-delay product plus one: the rate at which our hops complete
(BBR's delivery rate: the micro-batches completed while one was out, over its time out;
the most of the recent samples, as a window-limited sample only underestimates) times
the least time a micro-batch is out, plus one to probe for more. A compute-bound stage
completes at its compute's pace, and this figure is then about the compute window's.

A hop's deadline is about a stall, not a full honest link: the micro-batches in flight
cross the link one after another, so a hop is given ``DEADLINE_GAIN`` times the time the
link takes to move them all at the typical (median) rate, never less than the floor
(NodeConfig.hop_timeout_s; unmeasured, each micro-batch in flight is taken to need it) nor
more than the cap (NodeConfig.max_hop_deadline_s, which is also the most a caller may
ask of a stage that serves it)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_WINDOW = 2
# While a round's payload moves, stage 0 keeps this many in flight: the payload takes the
# rest of its uplink (paced flows share a link alike, so with a window of W it had 1/(W+1)
# of it, and a payload of 1.6 MB outlasted its exchange's deadline at 1 Mbit/s); the
# payload is short next to a round, and the link stays busy with it.
ROUND_WINDOW = 1
RECENT = 32  # micro-batches whose times count
PACE_SAMPLES = 8  # delivered and computed micro-batches before the pace is judged
DEADLINE_GAIN = 3.0  # a hop's deadline over the time the link takes for what is in flight


@dataclass
class InFlightWindow:
    max_in_flight: int
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # micro-batches/s delivered
    completed: int = 0  # micro-batches delivered (the delivery-rate samples count them)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")

    def note(self, compute_s: float, wait_s: float) -> None:
        """One micro-batch done: its forward plus backward at this stage, and how long it
        waited for its gradient in between."""
        if compute_s > 0 and wait_s >= 0:
            self.compute_s.append(compute_s)
            self.wait_s.append(wait_s)

    def sent(self, now: float) -> tuple[int, float]:
        """A micro-batch goes out: the mark its delivery-rate sample is taken against."""
        return self.completed, now

    def delivered(self, mark: tuple[int, float], now: float) -> None:
        """The micro-batch sent at ``mark`` came back at ``now``: a delivery-rate sample."""
        self.completed += 1
        completed_then, sent_at = mark
        if now > sent_at:
            self.rates.append((self.completed - completed_then) / (now - sent_at))

    def link_rate(self) -> float | None:
        """Micro-batches a second our hops deliver at best lately; None until measured."""
        return max(self.rates) if self.rates else None

    def paced_share(self) -> float | None:
        """Micro-batches our hops deliver a second at best lately over those our compute
        does: under 1, something past our compute (the link, the next stage) sets the
        pace (train/uplink.py reads it); None until PACE_SAMPLES of each are measured."""
        if len(self.rates) < PACE_SAMPLES or len(self.compute_s) < PACE_SAMPLES:
            return None
        return self.link_rate() * statistics.median(self.compute_s)

    def size(self, next_stage_accepts: int) -> int:
        """Micro-batches to keep in flight; ``next_stage_accepts``: how many the next
        stage's live peers take from us at once (their count times each one's cap)."""
        cap = max(1, min(self.max_in_flight, next_stage_accepts))
        if not self.compute_s:
            return min(MIN_WINDOW, cap)
        compute_s = statistics.median(self.compute_s)
        out_s = compute_s + min(self.wait_s)
        needed = math.ceil(out_s / compute_s) + 1
        rate = self.link_rate()
        if rate is not None:
            needed = min(needed, math.ceil(rate * out_s) + 1)
        return max(min(MIN_WINDOW, cap), min(needed, cap))

    def pace(self) -> str:
        """The delivery rates a hop's deadline reads, for a lost micro-batch's log line."""
        if not self.rates:
            return "link unmeasured"
        return (f"link {statistics.median(self.rates):.2f} micro-batches/s typical, "
                f"{max(self.rates):.2f} at best, {len(self.rates)} samples")

    def deadline_s(self, in_flight: int, floor_s: float, cap_s: float) -> float:
        """A hop's deadline with ``in_flight`` of ours in the pipeline, this one included."""
        if not self.rates:  # unmeasured: each micro-batch in flight taken to need the floor on the link
            return min(cap_s, DEADLINE_GAIN * floor_s * max(1, in_flight))
        rate = statistics.median(self.rates)  # the typical pace: a burst of completions must not shorten it
        return min(cap_s, max(floor_s, DEADLINE_GAIN * max(1, in_flight) / rate))


@dataclass
class ServedRate:
    """A later stage's answers a second lately (its uplink carries them back): the pace
    at which it served the previous stage's micro-batches, the most recent ones."""
    at: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def note(self, now: float) -> None:
        self.at.append(now)

    def rate(self) -> float | None:
        if len(self.at) < 2 or self.at[-1] <= self.at[0]:
            return None
        return (len(self.at) - 1) / (self.at[-1] - self.at[0])
