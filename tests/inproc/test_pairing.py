"""The pairing rule in-process: many coordinators on a fake network whose calls go
straight to the other coordinator's handler (with random delivery delays)."""

import asyncio
import random

import pytest

from swarm_node.errors import PeerTimeout
from swarm_node.gossip.pairing import PairingCoordinator, Refused


async def run_swarm(n: int, seed: int, *, dead: set[str] = frozenset(), start_jitter_s: float = 0.02,
                    round_timeout_s: float = 1.0):
    rng = random.Random(seed)
    names = [f"peer{i}" for i in range(n)]
    nodes = {name: PairingCoordinator(round_timeout_s=round_timeout_s, request_timeout_s=0.3,
                                      backoff_s=(0.001, 0.01), rng=random.Random(rng.random()))
             for name in names}

    async def send_from(sender, peer, payload, timeout):
        await asyncio.sleep(rng.uniform(0, 0.003))
        if peer in dead:
            await asyncio.sleep(timeout)
            raise PeerTimeout("dead")
        reply = nodes[peer].on_request(sender, payload)  # may raise Refused
        await asyncio.sleep(rng.uniform(0, 0.003))
        return reply

    async def one(name):
        await asyncio.sleep(rng.uniform(0, start_jitter_s))
        return await nodes[name].run_round(
            0, f"payload-of-{name}",
            candidates=lambda: [(p, nodes[p].state.value == "seeking") for p in names if p != name],
            send=lambda peer, payload, timeout: send_from(name, peer, payload, timeout))

    live = [name for name in names if name not in dead]
    results = await asyncio.gather(*(one(name) for name in live))
    return dict(zip(live, results))


@pytest.mark.parametrize("n,seed", [(2, 0), (4, 1), (5, 2), (8, 3), (7, 4), (16, 5)])
def test_pairs_are_mutual_and_everyone_but_an_odd_one_pairs(n, seed):
    results = asyncio.run(run_swarm(n, seed))
    for name, result in results.items():
        if result is not None:
            partner = results[result.partner]
            assert partner is not None and partner.partner == name, f"{name} -> {result.partner} not mutual"
            assert result.payload == f"payload-of-{result.partner}"
            assert partner.initiated != result.initiated
    unpaired = [name for name, r in results.items() if r is None]
    assert len(unpaired) == n % 2


def test_pairing_differs_between_rounds():
    partners = {frozenset((a, r.partner)) for seed in range(6)
                for a, r in asyncio.run(run_swarm(4, seed)).items() if r}
    assert len(partners) > 2


def test_a_dead_peer_costs_at_most_the_round_deadline():
    loop_results = asyncio.run(run_swarm(4, 7, dead={"peer3"}, round_timeout_s=1.0))
    paired = [r for r in loop_results.values() if r is not None]
    assert len(paired) == 2  # two of the three live peers pair, the third goes local-only
    assert all(r.partner != "peer3" for r in paired)


def test_refuses_when_not_seeking():
    node = PairingCoordinator(round_timeout_s=1, request_timeout_s=1)
    with pytest.raises(Refused, match="not-ready"):
        node.on_request("x", None)


async def run_group(n: int, seed: int, dead: set[str] = frozenset()):
    from swarm_node.gossip.group import GroupRound

    rng = random.Random(seed)
    names = [f"peer{i}" for i in range(n)]
    nodes = {name: GroupRound(round_timeout_s=1.0, request_timeout_s=0.3, backoff_s=(0.001, 0.01),
                              rng=random.Random(rng.random())) for name in names}

    async def send_from(sender, peer, payload, timeout):
        await asyncio.sleep(rng.uniform(0, 0.003))
        if peer in dead:
            raise PeerTimeout("dead")
        return nodes[peer].on_request(sender, payload)

    async def one(name):
        await asyncio.sleep(rng.uniform(0, 0.05))  # members reach the boundary at different times
        return await nodes[name].run_round(0, f"payload-of-{name}",
                                           members=lambda: [p for p in names if p != name],
                                           send=lambda peer, payload, t: send_from(name, peer, payload, t))

    live = [name for name in names if name not in dead]
    return dict(zip(live, await asyncio.gather(*(one(name) for name in live))))


@pytest.mark.parametrize("n", [2, 3, 6])
def test_group_round_gathers_every_members_contribution(n):
    results = asyncio.run(run_group(n, seed=n))
    for name, gathered in results.items():
        assert set(gathered) == {p for p in results if p != name}
        assert all(payload == f"payload-of-{peer}" for peer, payload in gathered.items())


def test_group_round_goes_on_without_a_dead_member():
    results = asyncio.run(run_group(4, seed=9, dead={"peer0"}))
    assert all(set(g) == {p for p in results if p != name} for name, g in results.items())
