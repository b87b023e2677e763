"""Next-hop choice, after SWARM's least projected finish time, randomised.

Each candidate's projected finish time is (its queue + our in-flight to it + 1) /
its throughput. A peer we have not measured yet gets the best throughput seen so far,
so new peers are probed first instead of starved. The choice is random with weight
1 / finish time, so load spreads over all peers while faster, emptier ones get more.
Peers that failed us are skipped while banned (net/guard.py decides for how long)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Candidate:
    peer_id: str
    throughput: float  # samples/s from its registry record; 0 when unknown
    queue: int


@dataclass
class PeerChooser:
    is_banned: Callable[[str], bool] = lambda peer: False
    rng: random.Random = field(default_factory=random.Random)
    in_flight: dict[str, int] = field(default_factory=dict)

    def choose(self, candidates: list[Candidate], exclude: set[str] = frozenset()) -> str | None:
        usable = [c for c in candidates if c.peer_id not in exclude and not self.is_banned(c.peer_id)]
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

    def started(self, peer_id: str) -> None:
        self.in_flight[peer_id] = self.in_flight.get(peer_id, 0) + 1

    def finished(self, peer_id: str) -> None:
        left = self.in_flight.get(peer_id, 0) - 1
        if left > 0:
            self.in_flight[peer_id] = left
        else:
            self.in_flight.pop(peer_id, None)
