"""Peers seeking a partner right now, as this node heard it, for the next proposal.

A registry record says ``seeking`` only as fresh as the last read of its shard, and in
a large stage a node reads each shard seldom: most proposals went to peers the view
said were seeking or past half of their round and that had moved on (13 refusals a
round at 64 peers a stage, three in four ``not-ready``). A peer that proposes to us is
seeking at that moment, for sure. So a node remembers the proposers it refused in the
last seconds, tries them itself when its own proposal is refused, and names a few of
them in its refusals (``seekers``, wire/messages.py), so that a refused proposer tries
a peer that is seeking rather than another guess.

What a peer says is a claim: a hinted peer is tried only if it is in our own view of
the stage and verified (net/guard.py), so a hint can reorder our choices among peers we
would propose to anyway and never adds one. First-hand proposers are what we name to
others; hints we were given are not passed on."""

from __future__ import annotations

from collections.abc import Callable

SEEKER_FRESH_S = 2.0  # a proposer is likely still seeking this long after it called (rounds pair in seconds)
MAX_HINTS = 3  # peers named in one refusal
MAX_TRACKED = 64  # each table's bound, whatever number of ids call us


class Seekers:
    def __init__(self, clock: Callable[[], float]):  # the pairing's clock (gossip/pairing.now)
        self.clock = clock
        self._heard: dict[str, float] = {}  # peer -> when it proposed to us and we refused (first hand)
        self._hinted: dict[str, float] = {}  # peer -> when a refuser named it

    def proposed(self, peer: str) -> None:
        """``peer`` proposed to us and we refused: it is seeking now."""
        _note(self._heard, peer, self.clock())

    def hinted(self, peers: list[str]) -> None:
        """A refuser named ``peers`` as seeking."""
        at = self.clock()
        for peer in peers:
            _note(self._hinted, peer, at)

    def tried(self, peer: str) -> None:
        """We proposed to ``peer``, or paired with it: not a lead any more."""
        self._heard.pop(peer, None)
        self._hinted.pop(peer, None)

    def hints_for(self, asker: str) -> list[str]:
        """What a refusal to ``asker`` names: the freshest first-hand seekers but itself."""
        since = self.clock() - SEEKER_FRESH_S
        fresh = [p for p, at in sorted(self._heard.items(),
                                       key=lambda item: -item[1]) if at >= since and p != asker]
        return fresh[:MAX_HINTS]

    def fresh(self) -> set[str]:
        """Peers heard seeking in the last SEEKER_FRESH_S, first hand or hinted."""
        since = self.clock() - SEEKER_FRESH_S
        return {p for table in (self._heard, self._hinted) for p, at in table.items() if at >= since}


def _note(table: dict[str, float], peer: str, at: float) -> None:
    table.pop(peer, None)
    table[peer] = at
    while len(table) > MAX_TRACKED:
        table.pop(next(iter(table)))
