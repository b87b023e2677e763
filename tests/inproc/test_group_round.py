"""DiLoCo's group round in-process (gossip/group.py): members on a fake network whose
calls go straight to the other member's handler, on the virtual clock of tests/vclock.py
(delays, dead members' time-outs and deadlines take no real time)."""

import asyncio
import random

import pytest
import vclock

from swarm_node.errors import PeerTimeout
from swarm_node.gossip.group import GroupRound
from swarm_node.gossip.pairing import Refused
from swarm_node.gossip.payloads import SERVED_AT_ONCE


def group_round(**settings) -> GroupRound:
    """A member that serves as many calls at once as the node's payload protocols do."""
    return GroupRound(served_at_once=SERVED_AT_ONCE, **settings)


async def run_group(n: int, seed: int, dead: set[str] = frozenset()):
    rng = random.Random(seed)
    names = [f"peer{i}" for i in range(n)]
    nodes = {name: group_round(round_timeout_s=1.0, request_timeout_s=0.3, backoff_s=(0.001, 0.01),
                               rng=random.Random(rng.random()), own_id=name) for name in names}

    async def send_from(sender, peer, payload, timeout):
        await asyncio.sleep(rng.uniform(0, 0.003))
        if peer in dead:
            raise PeerTimeout("dead")
        nodes[peer].on_request(sender, payload)
        if not nodes[peer].may_fetch(sender):
            raise Refused("not-ready")
        return f"payload-of-{peer}"

    async def one(name):
        await asyncio.sleep(rng.uniform(0, 0.05))  # members reach the boundary at different times
        return await nodes[name].run_round(0, f"payload-of-{name}",
                                           members=lambda: [p for p in names if p != name],
                                           send=lambda peer, payload, t: send_from(name, peer, payload, t))

    live = [name for name in names if name not in dead]
    return dict(zip(live, await asyncio.gather(*(one(name) for name in live))))


@pytest.mark.parametrize("n", [2, 3, 6])
def test_group_round_gathers_every_members_contribution(n):
    results = vclock.run(run_group(n, seed=n))
    for name, gathered in results.items():
        assert set(gathered) == {p for p in results if p != name}
        assert all(payload == f"payload-of-{peer}" for peer, payload in gathered.items())


def test_group_round_goes_on_without_a_dead_member():
    results = vclock.run(run_group(4, seed=9, dead={"peer0"}))
    assert all(set(g) == {p for p in results if p != name} for name, g in results.items())


async def run_group_on_links(n: int, exchange_s: float, own_ids: bool = True):
    """Members on links of their own: an exchange takes ``exchange_s`` times the most
    exchanges either end's link carries while it runs (they share its rate), and a call
    past its deadline fails. Returns each member's contributions and the exchanges made."""
    names = [f"peer{i}" for i in range(n)]
    nodes = {name: group_round(round_timeout_s=2 * exchange_s, request_timeout_s=1.5 * exchange_s,
                               backoff_s=(0.001, 0.01), rng=random.Random(i), own_id=name if own_ids else "")
             for i, name in enumerate(names)}
    on_link = dict.fromkeys(names, 0)
    exchanges, calls = [], []

    async def send_from(sender, peer, payload, timeout):
        calls.append((sender, peer))
        on_link[sender] += 1
        on_link[peer] += 1
        try:
            took = exchange_s * max(on_link[sender], on_link[peer])
            if took > timeout:
                await asyncio.sleep(timeout)
                raise PeerTimeout("the link is shared")
            await asyncio.sleep(took)
            nodes[peer].on_request(sender, payload)
            exchanges.append((sender, peer))
            return f"payload-of-{peer}"
        finally:
            on_link[sender] -= 1
            on_link[peer] -= 1

    async def one(name):
        return await nodes[name].run_round(0, f"payload-of-{name}",
                                           members=lambda: [p for p in names if p != name],
                                           send=lambda peer, payload, t: send_from(name, peer, payload, t))

    return dict(zip(names, await asyncio.gather(*(one(name) for name in names)))), exchanges, calls


def test_a_group_round_on_shared_links_gathers_everyone_each_pair_exchanging_once():
    """Four members whose exchanges share their links: calls sized for one exchange each
    timed out, and rounds went local-only (bench.home_link, 4 Mbit/s). Sized for the
    exchanges beside them, every member gathers every other's payload, and of each pair
    one calls: every payload crosses each link once."""
    results, exchanges, calls = vclock.run(run_group_on_links(4, exchange_s=1.0))
    assert all(set(gathered) == {p for p in results if p != name} for name, gathered in results.items())
    assert (
        sorted(exchanges)
        == sorted(calls)
        == [(a, b) for a in sorted(results) for b in sorted(results) if a < b]
    )
    # without the tie-break both ends of each pair call at once: twice the exchanges share
    # each link, and calls time out and go again
    _, _, both_calling = vclock.run(run_group_on_links(4, exchange_s=1.0, own_ids=False))
    assert len(both_calling) > 2 * len(calls)


def test_a_groups_deadlines_grow_with_the_link_not_with_the_floor():
    """Only the link's part of an exchange's deadline grows with the exchanges sharing it:
    on a fast link (the 30 s floor above the link's 3 s) a gather among 4 keeps the
    round's deadline, and a member that never answers costs what it did; on a 4 Mbit/s
    link (18.5 s of payload) calls and the gather stretch to what the shared link needs."""
    fast = group_round(round_timeout_s=20.0, request_timeout_s=30.0, link_s=3.0)
    assert fast.deadlines(3) == (20.0, 30.0, 9.0)
    home = group_round(round_timeout_s=20.0, request_timeout_s=30.0, link_s=18.5)
    assert home.deadlines(3) == pytest.approx((111.0, 55.5, 55.5))
    assert home.deadlines(20)[1] == pytest.approx(18.5 * home.most_sharing)  # a call shares with 8 at most


def test_a_higher_member_calls_a_lower_one_whose_call_never_comes():
    """The lower id calls; a lower member that does not (it counts only some members, or
    is late) is called by the higher one after a call's time, within the round."""
    async def scenario():
        high = group_round(round_timeout_s=5.0, request_timeout_s=1.0, own_id="peerB",
                           backoff_s=(0.001, 0.01))
        calls = []

        async def send(peer, payload, timeout):
            calls.append((peer, asyncio.get_running_loop().time()))
            return "payload-of-peerA"

        started = asyncio.get_running_loop().time()
        gathered = await high.run_round(0, "payload-of-peerB", members=lambda: ["peerA"], send=send)
        return gathered, [(peer, at - started) for peer, at in calls]

    gathered, calls = vclock.run(scenario())
    assert gathered == {"peerA": "payload-of-peerA"}
    assert len(calls) == 1 and calls[0][0] == "peerA" and 1.0 <= calls[0][1] < 1.1
