"""How a stage-0 node believes slot claims (data/claims.py) and picks a slot
(data/slot_batches.py choose_slot): a claim moves it only when its peer is known to exist;
claims not believed yet are still kept clear of when it picks; forged claimants cost a
few probes, each banned; peers that see part of the stage (a sharded registry) seldom
pick the same slot."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random

from swarm_node.data.claims import MAX_PROBES, SlotClaims
from swarm_node.data.slot_batches import choose_slot, slot_start
from swarm_node.errors import StreamClosed
from swarm_node.net import protocols
from swarm_node.net.guard import PeerGuard
from swarm_node.wire.frames import encode_frame


def test_a_claim_not_believed_never_moves_a_peer_but_is_kept_clear_of_when_it_picks():
    own, first = "QmVictim", "Qm1Forged"
    # a claim on our slot, with precedence: believed, it moves us; unconfirmed, it does not
    assert choose_slot(own, {first: 2}, 4, 2) != 2
    assert choose_slot(own, {}, 4, 2, unconfirmed={first: 2}) == 2
    # picking: the first slot from where our id hashes that no claim of either kind names
    start = slot_start(own, 4)
    assert choose_slot(own, {}, 4, None, unconfirmed={first: start}) == (start + 1) % 4
    # every slot named, some only by unconfirmed claims: those count as free
    believed = {"QmA": start, "QmB": (start + 1) % 4}
    unconfirmed = {"QmC": (start + 2) % 4, "QmD": (start + 3) % 4}
    assert choose_slot(own, believed, 4, None, unconfirmed) == (start + 2) % 4
    # every slot believed taken: the one our id hashes to
    assert choose_slot(own, {f"Qm{i}": i for i in range(4)}, 4, None) == start


class Net:
    """Answers status requests for the peers in ``running``; the others do not exist."""

    def __init__(self, running=()):
        self.running, self.asked = set(running), []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes):
        assert protocol == protocols.STATUS
        self.asked.append(peer)
        if peer not in self.running:
            raise StreamClosed("routing: not found")
        return encode_frame({"kind": "status", "ok": True})


def test_claims_are_believed_of_verified_peers_and_forged_claimants_cost_a_few_probes_each_banned():
    now = [0.0]
    guard = PeerGuard(clock=lambda: now[0])
    own, slot = "QmVictim", 3
    forged = [f"Qm1Forged{i:02d}" for i in range(40)]
    records = {p: slot for p in forged} | {"Qm1Honest": slot, "QmZLater": slot, "QmElse": 1}
    guard.reached("QmElse")
    net = Net(running=["Qm1Honest", "QmZLater"])
    claims = SlotClaims(lambda: dict(records), guard, net, rng=random.Random(0))

    believed, unconfirmed = claims.split()
    assert believed == {"QmElse": 1} and set(unconfirmed) == set(forged) | {"Qm1Honest", "QmZLater"}
    # only those that would take our slot are asked: not a larger id, not another slot
    assert set(claims.contesting(own, slot)) == set(forged) | {"Qm1Honest"}

    for _ in range(12):  # a minute of looks, one each 5 s
        asked = len(net.asked)
        asyncio.run(claims.verify(own, slot))
        assert len(net.asked) - asked <= MAX_PROBES
        now[0] += 5.0
    assert guard.is_verified("Qm1Honest") and net.asked.count("Qm1Honest") == 1
    assert claims.split()[0] == {"QmElse": 1, "Qm1Honest": slot}
    assert not any(guard.is_verified(p) for p in forged)
    # a forged claimant that failed is banned 5 s, then 10 s, ...: asked at most 4 times a minute
    assert max(net.asked.count(p) for p in forged) <= 4 and "QmZLater" not in net.asked


def test_a_peer_behind_a_forged_flood_is_asked_within_one_pass_over_the_flood():
    """Forty forged claimants and one that runs: claimants whose probe failed go after
    those never asked, so the real one is asked within ceil(41 / MAX_PROBES) looks, once."""
    now = [0.0]
    guard = PeerGuard(clock=lambda: now[0])
    records = {f"Qm1Forged{i:02d}": 0 for i in range(40)} | {"Qm1Honest": 0}
    net = Net(running=["Qm1Honest"])
    for seed in range(5):
        claims = SlotClaims(lambda: dict(records), guard, net, rng=random.Random(seed))
        for look in range(1, 40):  # noqa: B007 (the last look is read after the loop)
            asyncio.run(claims.verify("QmVictim", 0))
            if guard.is_verified("Qm1Honest"):
                break
            now[0] += 5.0
        assert look <= math.ceil(41 / MAX_PROBES) and net.asked.count("Qm1Honest") == 1
        assert len(set(net.asked)) == len(net.asked)  # nobody asked twice before everyone was asked once
        guard, net.asked = PeerGuard(clock=lambda: now[0]), []


def _views(peers: int, slots: int, visible: float, looks: int, seed: int) -> tuple[int, int]:
    """Peers join one at a time, each seeing ``visible`` of the others' claims at each
    look, then look ``looks`` more times; (peers sharing a slot at the end, moves)."""
    rng = random.Random(seed)
    ids = ["Qm" + hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[:40] for i in range(peers)]
    claims, moves = {}, 0
    for peer in ids:
        seen = {q: s for q, s in claims.items() if rng.random() < visible}
        claims[peer] = choose_slot(peer, seen, slots, None)
    for _ in range(looks):
        for peer in ids:
            seen = {q: s for q, s in claims.items() if q != peer and rng.random() < visible}
            slot = choose_slot(peer, seen, slots, claims[peer])
            moves += slot != claims[peer]
            claims[peer] = slot
    return peers - len(set(claims.values())), moves


def test_peers_that_see_a_quarter_of_the_stage_seldom_share_a_slot_or_move():
    """A sharded registry's view holds part of stage 0: 16 peers, 64 slots, each look
    sees a quarter of the others; five such runs. Picking the lowest free slot, peers
    went for the few lowest ones they happened not to see: 50 of the 80 shared a slot
    after three looks, with 86 moves (each a slot begun again where another peer had
    trained). Counting on from where each id hashes: 3 and 2."""
    shared, moves = map(sum, zip(*(_views(16, 64, 0.25, looks=3, seed=seed) for seed in range(5))))
    assert shared <= 8 and moves <= 10, (shared, moves)
