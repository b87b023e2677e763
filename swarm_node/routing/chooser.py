"""Next-hop choice, after SWARM's least projected finish time, randomised.

Each candidate's projected finish time is (its queue + our in-flight to it + 1) /
its throughput. A peer we have not measured yet gets the best throughput seen so far,
so new peers are probed first instead of starved. The choice is random with weight
1 / finish time, so load spreads over all peers while faster, emptier ones get more.
Peers that failed us are skipped while banned (net/guard.py decides for how long).

The throughput is what our own hops to the peer measured (``RoundTrips``), and a peer
is measured only when it is chosen: a low figure makes it chosen seldom, so the figure
would hardly move and one slow answer would keep it under its share. An answer's say
therefore halves every ``FADE_TURNS`` turns the peer is not measured (a turn is one hop
for each peer measured, so this scales with the pipeline's pace and the number of
peers), and beside the answers the best known rate keeps a small say (``PRIOR_SAY``): a
peer not chosen lately drifts towards the best rate and is probed again within a few
turns. A recovered peer so gets its share back at once; a really slow one is measured
slow again, at the cost of a probe every few turns. A peer measured on each of its
turns keeps about the smoothing of an EMA of 0.1 (docs/ARCHITECTURE.md, "Why it is this
way").

A link-bound hop (our uplink sets the pace: train/uplink.py) does not spread: it
keeps to a peer of its own (routing/sticky.py)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from swarm_node.routing.sticky import BodyRates, StickyChoice

# An answer's say halves every FADE_TURNS turns: a peer measured on each of its turns is a
# mean of about its last 17 answers (in the variance sense; an EMA of 0.1 averaged about 19).
FADE_TURNS = 6.0
PRIOR_SAY = 0.25  # the best known rate's say beside a peer's own answers (a quarter of one fresh answer)


@dataclass
class Candidate:
    peer_id: str
    throughput: float  # samples/s (what we measured, or what the caller vouches for); 0 when unknown
    queue: int
    confidence: float = 1.0  # the throughput's say against the best known rate's (RoundTrips.candidate)


@dataclass
class PeerChooser:
    is_banned: Callable[[str], bool] = lambda peer: False
    rng: random.Random = field(default_factory=random.Random)
    in_flight: dict[str, int] = field(default_factory=dict)
    sticky: StickyChoice = field(default_factory=StickyChoice)  # link-bound hops (routing/sticky.py)

    def choose(self, candidates: list[Candidate], exclude: set[str] = frozenset(),
               per_peer: int | None = None,
               body_rates: BodyRates | None = None) -> str | None:
        """A peer, or None when none is usable; ``per_peer``: skip peers that many of our
        hops are already out to (what a peer serves one caller at once). With
        ``body_rates`` (link-bound: train/uplink.py) the hop keeps
        to a peer of its own instead of spreading (routing/sticky.py)."""
        usable = [c for c in candidates if c.peer_id not in exclude and not self.is_banned(c.peer_id)
                  and (per_peer is None or self.in_flight.get(c.peer_id, 0) < per_peer)]
        if not usable:
            return None
        if body_rates is not None:
            at_cap = frozenset(c.peer_id for c in candidates if per_peer is not None
                               and self.in_flight.get(c.peer_id, 0) >= per_peer)
            return self.sticky.choose([c.peer_id for c in usable], body_rates, self.rng, at_cap)
        known = [c.throughput for c in usable if c.throughput > 0]
        probe_rate = max(known) if known else 1.0
        weights = []
        for c in usable:
            rate = probe_rate - (probe_rate - c.throughput) * c.confidence if c.throughput > 0 else probe_rate
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


@dataclass(frozen=True)
class _Say:
    """A peer's answers, each weighted by its say: 1 when it came, halving every
    FADE_TURNS turns since (``weight``, and ``weighted_rate`` the rates times their say)."""
    weight: float
    weighted_rate: float
    at_hop: int


@dataclass
class RoundTrips:
    """Samples/s of our hops to each peer: the mean of its answers (samples / round-trip
    seconds), each weighted by its say, which halves every FADE_TURNS turns (a turn is one
    hop for each peer measured); beside them the best known rate has a say of PRIOR_SAY.
    The chooser takes the mean and its confidence (say / (say + PRIOR_SAY)) and fills
    the rest with the best known rate."""
    says: dict[str, _Say] = field(default_factory=dict)
    hops: int = 0  # answers measured, to any peer

    def note(self, peer_id: str, samples: int, seconds: float) -> None:
        if seconds <= 0:
            return
        weight, weighted_rate = self._faded(peer_id)
        self.hops += 1
        self.says[peer_id] = _Say(weight + 1.0, weighted_rate + samples / seconds, self.hops)

    def candidate(self, peer_id: str, queue: int) -> Candidate:
        weight, weighted_rate = self._faded(peer_id)
        if weight <= 0:
            return Candidate(peer_id, 0.0, queue)
        return Candidate(peer_id, weighted_rate / weight, queue, confidence=weight / (weight + PRIOR_SAY))

    def keep_only(self, peers: Iterable[str]) -> None:
        """Forget peers that left: they would count in every turn."""
        keep = set(peers)
        for gone in [p for p in self.says if p not in keep]:
            del self.says[gone]

    def _faded(self, peer_id: str) -> tuple[float, float]:
        say = self.says.get(peer_id)
        if say is None:
            return 0.0, 0.0
        turns = (self.hops - say.at_hop) / len(self.says)
        fade = 0.5 ** (turns / FADE_TURNS)
        return say.weight * fade, say.weighted_rate * fade
