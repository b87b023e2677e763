"""Slot claims from registry records, as RunData believes them: a record anyone can sign,
for a peer id that sorts before the victim's, claims the victim's slot again after each
of its looks. Nothing behind the record answers: the claim moves nothing. A real peer
behind it moves the victim at most once in SLOT_MOVE_EVERY_S, and back to where it left
each slot: no window is trained twice in a pass, and the position never starts over."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math

from data_parts import FakeNet, answering_status, serving
from test_data_fetch import host_folder  # noqa: F401 (a fixture)

from swarm_node.data import source
from swarm_node.data.source import RunData
from swarm_node.data.spec import DataSpec
from swarm_node.errors import StreamClosed
from swarm_node.net.guard import PeerGuard
from swarm_node.spec import RunSpec

ATTACKER = "Qm1Attacker"  # sorts before every id of the form Qm[A-Za-z]...
VICTIM = "QmVictim"
LOOKS = 30
BATCHES_A_LOOK = 5


def claim_the_victims_slot(tmp_path, folder, digest, net, clock):
    """The victim's batches while the attacker claims its slot before each look (one
    look each SLOT_CHECK_S on ``clock``): [(pass, slot, position, hash of the batch)]."""
    spec = RunSpec(seq_len=64, batch_size=8, data=DataSpec(kind="manifest", manifest_sha256=digest, slots=4))
    net.handlers["QmBoot"] = serving(folder, digest).handle
    guard = PeerGuard(clock=clock)
    data = RunData(spec, cache_dir=tmp_path, cache_gb=None, initial_peers=["QmBoot"], peers=list,
                   on_fault=lambda peer, why: None, progress=False, guard=guard)
    data.clock = clock
    claims: dict[str, int] = {}

    async def run():
        await data.open(net, asyncio.to_thread)
        data.open_loader(peer_id=VICTIM, batch_size=8, shard=(0, 1), resumed=None,
                         claims=lambda: dict(claims))
        batches = []
        for _ in range(LOOKS):
            claims[ATTACKER] = data.claimed_slot()  # the next registry read shows the forged claim
            clock.now += source.SLOT_CHECK_S
            data._checked_at = -math.inf  # a look is due
            for _ in range(BATCHES_A_LOOK):
                await data.loader.ready()
                p = data.loader.position
                where = (p.data_pass, data.claimed_slot(), p.unit, p.offset)
                inputs, _ = data.loader.next_batch()
                batches.append((*where, hashlib.sha256(inputs.numpy().tobytes()).hexdigest()))
            await asyncio.sleep(0)  # a probe under way gets its answer
        await data.close()
        return batches

    return asyncio.run(run()), guard


async def nobody_there(remote, request):
    """A record with no process behind it: the dial fails."""
    raise StreamClosed("routing: not found")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def assert_no_window_twice_and_no_restart(batches):
    hashes = [(data_pass, digest) for data_pass, _, _, _, digest in batches]
    assert len(hashes) == len(set(hashes)), "a batch trained twice in one pass"
    by_slot: dict[tuple[int, int], tuple[int, int]] = {}
    for data_pass, slot, unit, offset, _ in batches:  # in each slot, the position only moves on
        assert (unit, offset) > by_slot.get((data_pass, slot), (-1, -1)), (data_pass, slot, unit, offset)
        by_slot[(data_pass, slot)] = (unit, offset)


def test_a_forged_record_claiming_a_nodes_slot_never_moves_it(tmp_path, host_folder):  # noqa: F811
    folder, _, digest = host_folder
    net = FakeNet()
    net.handlers[ATTACKER] = nobody_there
    batches, guard = claim_the_victims_slot(tmp_path, folder, digest, net, Clock())
    assert_no_window_twice_and_no_restart(batches)
    assert {slot for _, slot, _, _, _ in batches} == {batches[0][1]}  # never moved
    assert batches[-1][2:4] > (0, 0)  # and got on in its slot
    asked = [request for peer, request in net.calls if peer == ATTACKER]
    assert asked and all(r["kind"] == "status" for r in asked)
    # each failed probe bans it, 5 s doubling: asked at most once in each of those
    assert len(asked) <= 1 + math.ceil(math.log2(LOOKS * source.SLOT_CHECK_S / 5))
    assert not guard.is_verified(ATTACKER)


def test_a_real_peer_claiming_a_nodes_slot_again_and_again_moves_it_seldom_and_never_back_to_its_start(
        tmp_path, host_folder):  # noqa: F811
    folder, _, digest = host_folder
    net = FakeNet()
    net.handlers[ATTACKER] = answering_status  # it runs, so its claim is believed
    batches, guard = claim_the_victims_slot(tmp_path, folder, digest, net, Clock())
    assert_no_window_twice_and_no_restart(batches)
    assert guard.is_verified(ATTACKER)
    slots = [slot for _, slot, _, _, _ in batches]
    moves = sum(a != b for a, b in itertools.pairwise(slots))
    looks_s = LOOKS * source.SLOT_CHECK_S
    assert 2 <= moves <= looks_s / source.SLOT_MOVE_EVERY_S + 1, slots
    assert len(set(slots)) == 2  # back and forth between two slots, each taken up where it was left
