"""Next-hop choice, after SWARM's least projected finish time, randomised.

Each candidate's projected finish time is (its queue + our in-flight to it + 1) /
its throughput. A peer we have not measured yet gets the best throughput seen so far,
so new peers are probed first instead of starved. The choice is random with weight
1 / finish time, so load spreads over all peers while faster, emptier ones get more.
A peer that fails is banned for a while; its ban doubles on repeated failure."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class Candidate:
    peer_id: str
    throughput: float  # samples/s from its registry record; 0 when unknown
    queue: int


@dataclass
class _Ban:
    until: float
    strikes: int


@dataclass
class PeerChooser:
    base_ban_s: float = 5.0
    max_ban_s: float = 120.0
    rng: random.Random = field(default_factory=random.Random)
    clock: callable = time.monotonic
    in_flight: dict[str, int] = field(default_factory=dict)
    _bans: dict[str, _Ban] = field(default_factory=dict)

    def choose(self, candidates: list[Candidate], exclude: set[str] = frozenset()) -> str | None:
        now = self.clock()
        usable = [c for c in candidates if c.peer_id not in exclude and not self.is_banned(c.peer_id, now)]
        if not usable:
            return None
        known = [c.throughput for c in usable if c.throughput > 0]
        probe_rate = max(known) if known else 1.0
        weights = []
        for c in usable:
            rate = c.throughput if c.throughput > 0 else probe_rate
            finish_s = (c.queue + self.in_flight.get(c.peer_id, 0) + 1) / rate
            weights.append(1.0 / finish_s)
        return self.rng.choices(usable, weights=weights, k=1)[0].peer_id

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        ban = self._bans.get(peer_id)
        return ban is not None and (now if now is not None else self.clock()) < ban.until

    def report_failure(self, peer_id: str) -> float:
        """Ban ``peer_id``; returns the ban length in seconds."""
        previous = self._bans.get(peer_id)
        strikes = previous.strikes + 1 if previous else 1
        length = min(self.max_ban_s, self.base_ban_s * 2 ** min(strikes - 1, 30))  # capped: no overflow
        self._bans[peer_id] = _Ban(self.clock() + length, strikes)
        return length

    def report_success(self, peer_id: str) -> None:
        ban = self._bans.get(peer_id)
        if ban is not None and self.clock() >= ban.until:
            del self._bans[peer_id]

    def started(self, peer_id: str) -> None:
        self.in_flight[peer_id] = self.in_flight.get(peer_id, 0) + 1

    def finished(self, peer_id: str) -> None:
        left = self.in_flight.get(peer_id, 0) - 1
        if left > 0:
            self.in_flight[peer_id] = left
        else:
            self.in_flight.pop(peer_id, None)
