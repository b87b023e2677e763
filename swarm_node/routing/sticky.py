"""The next hop of a link-bound pipeline: a peer of our own, not a spread.

While our bodies keep our uplink busy (train/uplink.py) the next stage's access links are
as slow as ours, and two callers sending to one peer at once each get half of its
downlink while another peer's idles. A random choice per hop collides that way about as
often as not (n callers over n peers keep about 1 - 1/e of the receiving links busy). So
a link-bound hop keeps to the peer that takes our bodies fastest, and leaves it for one
expected SWITCH_GAIN times faster: callers sharing a peer each see half their rate there,
and move until each has one of its own. A peer's figure is what our own bodies to it
measured lately (UplinkQueue.expected); one never measured, or not lately, counts as the
best rate we measured, so a peer we kept away from is tried again once ours slows. On
PROBE_SHARE of hops a random peer is measured without moving us.

In a fluid model of the 2 x 2 test bed (2 Mbit/s links, 1 MB micro-batches) the spread
gave 75 % of the links' rate with bodies side by side and 65 % one at a time, the
sticky choice 89-92 % with them one at a time; in the test bed itself
(tests/multihost/test_home_links.py, 2 Mbit/s, fp16) stage 0 went from 56-62 % to 75-77 %.
Measured body rates are noisy there (90-240 kB/s alone on a 250 kB/s link, as outer
payloads come and go), which is why the rule is this plain: a variant that probed more
while ours looked slow and less while probes confirmed it did worse (56-73 %)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SWITCH_GAIN = 1.2  # another peer must look this much faster before we leave ours
PROBE_SHARE = 0.05  # link-bound hops sent to a random peer, to measure it


@dataclass
class StickyChoice:
    current: str | None = None  # the peer we keep to

    def choose(self, usable: list[str], expected_rate: Callable[[str], float | None], rng: random.Random,
               at_cap: frozenset[str] = frozenset()) -> str:
        """A peer of ``usable`` by ``expected_rate`` (bytes/s we expect a body to it to
        move at); ``at_cap``: peers left out only because as many of our hops are out to
        them as they take from one caller (ours there: this hop overflows to the fastest
        other without moving us)."""
        expected = {peer: expected_rate(peer) or 0.0 for peer in usable}
        shuffled = usable[:]
        rng.shuffle(shuffled)  # ties broken at random
        fastest = max(shuffled, key=expected.__getitem__)
        if self.current not in expected:  # none yet, or ours is banned, tried, gone or at its cap
            if self.current not in at_cap:
                self.current = fastest
            return fastest
        if rng.random() < PROBE_SHARE:
            return rng.choice(usable)
        if expected[fastest] > SWITCH_GAIN * expected[self.current]:
            self.current = fastest
        return self.current
