"""The next hop of a link-bound pipeline: a peer of our own, not a spread.

While our uplink sets the pace (train/uplink.py) the next stage's access links are as
slow as ours, and two callers sending to one peer at once each get half of its downlink
while another peer's idles. A random choice per hop collides that way about as often as
not (n callers over n peers keep about 1 - 1/e of the receiving links busy). So a
link-bound hop keeps to a peer of its own and leaves it when
- ours is crowded: our bodies there lately moved at under CROWDED_SHARE of our best
  rate lately (train/uplink.py), as when another caller shares its downlink; we go to the other
  peer we expect fastest;
- or another is expected SWITCH_GAIN times faster than ours.
Either way only on MOVE_CHANCE of the hops it would: two callers with the same history
(both measured both peers crowded, together) otherwise move together and meet again
(in the test bed they shared one receiver for a minute, then the other for 40 s). A
peer's figure is what our own bodies to it measured lately (UplinkQueue.expected); one
never measured, or not lately, counts as the best rate we measured, so a peer we kept
away from is tried again. On PROBE_SHARE of hops a random peer is measured without
moving us.

In a fluid model of the 2 x 2 test bed (2 Mbit/s links, 1 MB micro-batches) the spread
gave 75 % of the links' rate with bodies side by side and 65 % one at a time, a sticky
choice 89-92 % with them one at a time. In the test bed itself
(tests/multihost/test_home_links.py, 2 Mbit/s, fp16) stage 0 reaches 70-72 % of what the
links allow with this rule, 56-62 % with the spread. Rules that left only for a peer
expected faster reached 52-78 % over seven runs: callers that met from the start never
measured a rate alone to compare with (body rates run 90-140 kB/s met, 130-245 alone on
250 kB/s links as outer payloads come and go), and two with the same history moved together.

Every RESHUFFLE_HOPS hops a caller draws its peer afresh at random, so that over a run
routing stays what NoLoCo asks (docs/ALGORITHM.md 4); a draw onto a taken peer is
parted by the crowded rule within a body or two."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

SWITCH_GAIN = 1.2  # another peer must look this much faster before we leave ours...
MOVE_CHANCE = 0.5  # ...and then we leave on this share of hops
PROBE_SHARE = 0.05  # link-bound hops sent to a random peer, to measure it
# every this many hops a link-bound caller draws its peer afresh at random: over a run each
# of its micro-batches still goes to any next-stage peer alike (docs/ALGORITHM.md 4)
RESHUFFLE_HOPS = 64


class BodyRates(Protocol):
    """What our own bodies measured (train/uplink.py UplinkQueue)."""

    def expected(self, peer_id: str) -> float | None:
        """Bytes/s a body to the peer should move at (None: nothing measured yet)."""

    def crowded(self, peer_id: str) -> bool:
        """Our bodies to the peer lately moved at well under the best rate we measured lately."""


@dataclass
class StickyChoice:
    current: str | None = None  # the peer we keep to
    hops: int = 0

    def choose(self, usable: list[str], rates: BodyRates, rng: random.Random,
               at_cap: frozenset[str] = frozenset()) -> str:
        """A peer of ``usable`` by what our bodies measured (``rates``); ``at_cap``: peers
        left out only because as many of our hops are out to them as they take from one
        caller (ours there: this hop overflows to the fastest other without moving us)."""
        expected = {peer: rates.expected(peer) or 0.0 for peer in usable}
        shuffled = usable[:]
        rng.shuffle(shuffled)  # ties broken at random
        fastest = max(shuffled, key=expected.__getitem__)
        self.hops += 1
        if self.hops % RESHUFFLE_HOPS == 0:
            self.current = rng.choice(usable)
            return self.current
        if self.current not in expected:  # none yet, or ours is banned, tried, gone or at its cap
            if self.current not in at_cap:
                self.current = fastest
            return fastest
        if rng.random() < PROBE_SHARE:
            return rng.choice(usable)
        others = [peer for peer in shuffled if peer != self.current]
        if others and rng.random() < MOVE_CHANCE:
            if rates.crowded(self.current):  # another caller shares its downlink: one of us leaves
                self.current = max(others, key=expected.__getitem__)
            elif expected[fastest] > SWITCH_GAIN * expected[self.current]:
                self.current = fastest
        return self.current
