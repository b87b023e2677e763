"""Our micro-batches' bodies cross our uplink one at a time, and what each next-stage
peer's link took them at.

Why one at a time: bodies sent side by side share the uplink, so all of them arrive
late and together, the next stage computes them together and their answers come back
together while our uplink idles; one after another, the first arrives at the link's
full rate and its answer is on its way while the next one crosses. While our bodies keep
the uplink busy the pipeline is link-bound, and the next hop keeps to the peer that took our
bodies fastest (routing/sticky.py): the rate is measured here (the
body's bytes over the time from its first byte to its last one written), never
taken from the peer. A body that keeps the uplink past ``hold_s`` (a receiver that stalls its
acknowledgements) lets the next one go beside it: a peer cannot hold our pipeline for
longer than that."""


from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass, field

RECENT_BODIES = 3  # a peer's upload rate: the mean of its last few bodies...
FRESH_BODIES = 8  # ...if one of them is among our last this many (to any peer)
LONG_BODIES = 64  # the best of our last this many: what a peer not measured lately is taken to move
# A body may hold our uplink this many times its time at the best rate we measured
# (or UNMEASURED_HOLD_S before any) before the next one goes beside it.
HOLD_GAIN = 3.0
MIN_HOLD_S = 1.0
UNMEASURED_HOLD_S = 10.0
BUSY_TURNS = 8  # the uplink is link-bound when our last this many turns held it...
LINK_BOUND_SHARE = 0.75  # ...this share of the time since the first began


class Turn:
    """One body's hold on the uplink; ``release`` is idempotent (the body done, the hop
    failed, or its hold ran out, whichever comes first)."""

    def __init__(self, queue: UplinkQueue, now: float):
        self._queue = queue
        self._held = True
        self._expiry: asyncio.TimerHandle | None = None
        self._from = now

    def release(self) -> None:
        if self._held:
            self._held = False
            if self._expiry is not None:
                self._expiry.cancel()
            self._queue._held(self._from, asyncio.get_running_loop().time())
            self._queue._lock.release()


@dataclass
class UplinkQueue:
    """Bodies sent one after another, and each peer's upload rate as we measured it
    lately: a figure from before our last FRESH_BODIES bodies says little about a link
    other callers may have come to or left since, and a peer we keep away from must be
    tried again (routing/sticky.py), so it then counts as the best of our last LONG_BODIES."""
    recent: dict[str, deque[float]] = field(default_factory=dict)  # bytes/s, per peer
    measured_at: dict[str, int] = field(default_factory=dict)  # the body count at its last body
    best: deque[float] = field(default_factory=lambda: deque(maxlen=LONG_BODIES))  # any peer's
    sent: int = 0  # bodies measured
    # our last turns: (held from, to)
    turns: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=BUSY_TURNS))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def turn(self, nbytes: int) -> Turn:
        """Wait for the uplink; the caller releases the turn once the body is written."""
        await self._lock.acquire()
        loop = asyncio.get_running_loop()
        turn = Turn(self, loop.time())
        turn._expiry = loop.call_later(self.hold_s(nbytes), turn.release)
        return turn

    def _held(self, since: float, until: float) -> None:
        self.turns.append((since, until))

    def link_bound(self, now: float) -> bool:
        """Our bodies have kept the uplink busy lately (LINK_BOUND_SHARE of the time since
        the first of our last BUSY_TURNS turns began): it, not the compute or the next
        stage, sets the pace. A compute-bound stage on a fast link (or loopback) holds it
        for moments between long gaps."""
        if len(self.turns) < BUSY_TURNS:
            return False
        held = sum(until - since for since, until in self.turns)
        return held >= LINK_BOUND_SHARE * (now - self.turns[0][0])

    def hold_s(self, nbytes: int) -> float:
        best = self.best_rate()
        if best is None:
            return UNMEASURED_HOLD_S
        return max(MIN_HOLD_S, HOLD_GAIN * nbytes / best)

    def note(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """A body of ``nbytes`` took ``seconds`` from its first byte to its last one written."""
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

    def best_rate(self) -> float | None:
        return max(self.best, default=None)

    def keep_only(self, peers: set[str] | dict) -> None:
        for gone in [p for p in self.recent if p not in peers]:
            del self.recent[gone], self.measured_at[gone]
