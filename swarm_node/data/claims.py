"""Whose slot claims a stage-0 node believes (data/slot_batches.py says what a slot is).

A record's ``data_slot`` is a claim, and anyone can sign records for fresh keys, with
peer ids that sort first if they like (a few dozen tries). So a claim moves us off our
slot only once its peer has shown it exists: it answered a call of ours or made one we
served (PeerGuard.is_verified). Peers not known to exist that claim our slot with
precedence are asked for their status, MAX_PROBES at a time, those whose probe never
failed first; one that does not answer is banned like any failed call (5 s, doubling
to 120 s). Forged records then cost a probe now and then and move nothing, and a real
peer among them is asked within one pass over them.

Claims not believed yet still count when we pick a free slot, so a joiner does not
land on a slot a peer visibly holds. A verified peer stays verified, so its claim
counts whenever its record is in our view: a sharded registry's view holds part of the
stage at a time, and a rule that wanted a claim seen without a break would never
believe one there. What a believed claim can do is bounded elsewhere: a move at most
every SLOT_MOVE_EVERY_S (data/source.py), and a move goes on where we left the slot in
this pass (SlotBatches.switch_slot)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from swarm_node.data.slot_batches import precedes
from swarm_node.net.exists import answers_status
from swarm_node.net.guard import PeerGuard
from swarm_node.net.transport import Requester

MAX_PROBES = 4  # claimants asked for their status at once
MAX_REMEMBERED = 4096  # claimants whose probe failed, remembered so that the others go first
PROBE_TIMEOUT_S = 5.0  # a status request: a few hundred bytes


class SlotClaims:
    """``records()``: peer -> slot as the live stage-0 records say (forged ones included);
    ``requester``: what asks a claimant for its status (None: nobody is asked)."""

    def __init__(self, records: Callable[[], dict[str, int]], guard: PeerGuard, requester: Requester | None,
                 rng: random.Random | None = None):
        self.records, self.guard, self.requester = records, guard, requester
        self.rng = rng or random.Random()
        self._probing: asyncio.Task | None = None
        self._failed: dict[str, None] = {}  # claimants that did not answer, oldest first

    def split(self) -> tuple[dict[str, int], dict[str, int]]:
        """(believed, unconfirmed) claims: of peers known to exist, and of the others."""
        believed, unconfirmed = {}, {}
        for peer, slot in self.records().items():
            (believed if self.guard.is_verified(peer) else unconfirmed)[peer] = slot
        return believed, unconfirmed

    def contesting(self, own: str, slot: int) -> list[str]:
        """Peers not known to exist whose claim, if true, would take ``slot`` from us;
        those banned for a failed call wait for their ban to end."""
        return [peer for peer, claimed in self.records().items() if claimed == slot and precedes(peer, own)
                and not self.guard.is_verified(peer) and not self.guard.is_banned(peer)]

    async def verify(self, own: str, slot: int) -> None:
        """Ask up to MAX_PROBES of the peers contesting ``slot`` whether they exist, at
        random among those whose probe never failed, then among the others."""
        if self.requester is None:
            return
        peers = self.contesting(own, slot)
        self.rng.shuffle(peers)
        peers.sort(key=lambda peer: peer in self._failed)
        await asyncio.gather(*(self._probe(peer, slot) for peer in peers[:MAX_PROBES]))

    def verify_soon(self, own: str, slot: int) -> None:
        """verify() in the background, one at a time: a claimant slow to answer (or a
        forged one that cannot) must not hold up the next batch."""
        if (self._probing is None or self._probing.done()) and self.requester is not None \
                and self.contesting(own, slot):
            self._probing = asyncio.get_running_loop().create_task(self.verify(own, slot))

    async def _probe(self, peer: str, slot: int) -> None:
        if await answers_status(self.requester, peer, PROBE_TIMEOUT_S):
            self.guard.succeeded(peer)
            self._failed.pop(peer, None)
            return
        self.guard.failed(peer)
        self.guard.ignore(peer, f"it claims our data slot {slot} and does not answer: its slot claims count "
                                "for nothing until it does")
        self._failed[peer] = None
        while len(self._failed) > MAX_REMEMBERED:
            del self._failed[next(iter(self._failed))]

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)
