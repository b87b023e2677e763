"""Whether our uplink sets the pipeline's pace, and while it does, our micro-batches'
bodies cross it one at a time and we measure what each next-stage peer's link takes them at.

Link-bound is judged from two things measured here, never taken from a peer: our hops
deliver at under ENTER_PACE of our compute's pace (the window's delivery rate times a
micro-batch's compute: routing/window.py), and our bodies kept the uplink busy
ENTER_BUSY of the time lately. It ends once the pace is back over LEAVE_PACE or the
uplink is busy under LEAVE_BUSY: a compute-bound card on a home link (bench.gpu_volunteer:
the link allows 1.5x what the cards compute, the bodies keep it busy two thirds of the
time) sits on neither edge, so its bodies go side by side and its hops spread as always.
A judgement on the busy share alone sat on its edge there and cost a quarter of the
compute (docs/FAILURES.md).

Why one at a time while link-bound: bodies sent side by side share the uplink, so all
of them arrive late and together, the next stage computes them together and their
answers come back together while our uplink idles; one after another, the first arrives
at the link's full rate and its answer is on its way while the next one crosses. And only
a body alone on our uplink measures the receiver's downlink: the next hop keeps to the
peer that took our bodies fastest (routing/sticky.py). A body's rate is its bytes over the
time from its first byte to its last one written. A body that keeps the uplink past
``hold_s`` (a receiver that stalls its acknowledgements) lets the next one go beside it:
a peer cannot hold our pipeline for longer than that."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

RECENT_BODIES = 3  # a peer's upload rate: the mean of its last few bodies...
FRESH_BODIES = 8  # ...if one of them is among our last this many (to any peer)
LONG_BODIES = 64  # the best of our last this many: what a peer not measured lately is taken to move
# a peer is crowded while its recent rate is under this share of the best of our last
# LONG_BODIES: two callers on one downlink each get half of it, and a pair that met often
# leaves few bodies alone in our history (90-140 kB/s met, 130-245 alone on 250 kB/s links)
CROWDED_SHARE = 0.65
# A body may hold our uplink this many times its time at the best rate we measured
# (or UNMEASURED_HOLD_S before any) before the next one goes beside it.
HOLD_GAIN = 3.0
MIN_HOLD_S = 1.0
UNMEASURED_HOLD_S = 10.0
BUSY_BODIES = 8  # the busy share: over the time since the first of our last this many bodies began
ENTER_PACE, LEAVE_PACE = 0.5, 0.8  # delivered over computed micro-batches a second
ENTER_BUSY, LEAVE_BUSY = 0.75, 0.5  # the share of the time a body of ours was on the uplink


class Turn:
    """One body on the uplink; ``release`` is idempotent (the body done, the hop failed,
    or its hold ran out, whichever comes first)."""

    def __init__(self, queue: UplinkQueue, exclusive: bool):
        self._queue = queue
        self._held = True
        self._exclusive = exclusive
        self._expiry: asyncio.TimerHandle | None = None

    def release(self) -> None:
        if self._held:
            self._held = False
            if self._expiry is not None:
                self._expiry.cancel()
            self._queue._body_ended(asyncio.get_running_loop().time())
            if self._exclusive:
                self._queue._lock.release()


@dataclass
class UplinkQueue:
    """Our bodies on the uplink, whether it is link-bound, and each peer's upload rate
    as we measured it lately: a figure from before our last FRESH_BODIES bodies says
    little about a link other callers may have come to or left since, and a peer we keep
    away from must be tried again (routing/sticky.py), so it then counts as the best of
    our last LONG_BODIES."""
    recent: dict[str, deque[float]] = field(default_factory=dict)  # bytes/s, per peer
    measured_at: dict[str, int] = field(default_factory=dict)  # the body count at its last body
    best: deque[float] = field(default_factory=lambda: deque(maxlen=LONG_BODIES))  # any peer's
    sent: int = 0  # bodies measured
    link_bound: bool = False  # as last judged (``judge``)
    busy_s: float = 0.0  # time with a body of ours on the uplink, in all, to the last change of ``on_link``
    # our last bodies: (when each began, busy_s then)
    began: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=BUSY_BODIES))
    on_link: int = 0  # our bodies on the uplink now
    changed_at: float = 0.0  # when on_link last changed
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def turn(self, nbytes: int) -> Turn:
        """Wait for the uplink (while link-bound: bodies one at a time); the caller
        releases the turn once the body is written."""
        exclusive = self.link_bound
        if exclusive:
            await self._lock.acquire()
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._body_began(now)
        turn = Turn(self, exclusive)
        if exclusive:
            turn._expiry = loop.call_later(self.hold_s(nbytes), turn.release)
        return turn

    def _tick(self, now: float) -> None:
        if self.on_link:
            self.busy_s += now - self.changed_at
        self.changed_at = now

    def _body_began(self, now: float) -> None:
        self._tick(now)
        self.on_link += 1
        self.began.append((now, self.busy_s))

    def _body_ended(self, now: float) -> None:
        self._tick(now)
        self.on_link -= 1

    def busy_share(self, now: float) -> float | None:
        """The share of the time since the first of our last BUSY_BODIES bodies began that
        one of ours was on the uplink; None before that many."""
        if len(self.began) < BUSY_BODIES or now <= self.began[0][0]:
            return None
        self._tick(now)
        since, busy_then = self.began[0]
        return (self.busy_s - busy_then) / (now - since)

    def judge(self, now: float, pace: float | None) -> bool:
        """Link-bound or not, with ``pace``: our hops' delivery rate over our compute's
        (None: not measured yet)."""
        busy = self.busy_share(now)
        was = self.link_bound
        if pace is None or busy is None:
            self.link_bound = False
        elif was:
            self.link_bound = pace <= LEAVE_PACE and busy >= LEAVE_BUSY
        else:
            self.link_bound = pace < ENTER_PACE and busy >= ENTER_BUSY
        if self.link_bound != was:
            log.info("%s: our hops deliver %.2f of our compute's pace, our uplink carried a body of ours "
                     "%.0f %% of the time; %s", "link-bound" if self.link_bound else "no longer link-bound",
                     pace or 0.0, 100 * (busy or 0.0),
                     "bodies one at a time, kept to one next-stage peer" if self.link_bound
                     else "bodies side by side, spread over next-stage peers")
        return self.link_bound

    def hold_s(self, nbytes: int) -> float:
        best = self.best_rate()
        if best is None:
            return UNMEASURED_HOLD_S
        return max(MIN_HOLD_S, HOLD_GAIN * nbytes / best)

    def note(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """A body of ``nbytes`` took ``seconds`` from its first byte to its last one
        written: alone on our uplink (link-bound) the receiver's rate for us; beside
        others (before) less, which only makes the best rate a floor."""
        if seconds > 0 and nbytes > 0:
            self.recent.setdefault(peer_id, deque(maxlen=RECENT_BODIES)).append(nbytes / seconds)
            self.best.append(nbytes / seconds)
            self.sent += 1
            self.measured_at[peer_id] = self.sent

    def rate(self, peer_id: str) -> float | None:
        recent = self.recent.get(peer_id)
        if not recent or self.measured_at[peer_id] <= self.sent - FRESH_BODIES:
            return None
        return statistics.fmean(recent)

    def expected(self, peer_id: str) -> float | None:
        """What a body to the peer should move at: as measured lately, else the best of our last bodies."""
        measured = self.rate(peer_id)
        return self.best_rate() if measured is None else measured

    def crowded(self, peer_id: str) -> bool:
        measured = self.rate(peer_id)
        if measured is None or len(self.best) < FRESH_BODIES:
            return False
        return measured < CROWDED_SHARE * self.best_rate()

    def best_rate(self) -> float | None:
        return max(self.best, default=None)

    def keep_only(self, peers: set[str] | dict) -> None:
        for gone in [p for p in self.recent if p not in peers]:
            del self.recent[gone], self.measured_at[gone]
