"""Our bodies cross our uplink one at a time, and link-bound hops keep to the peer that
takes them fastest (train/uplink.py, routing/chooser.py)."""

import asyncio
import random

import vclock

from swarm_node.routing.chooser import Candidate, PeerChooser
from swarm_node.routing.sticky import PROBE_SHARE, StickyChoice
from swarm_node.train.uplink import BUSY_TURNS, FRESH_BODIES, LONG_BODIES, UNMEASURED_HOLD_S, UplinkQueue


def test_bodies_take_the_uplink_one_after_another_and_keeping_it_busy_is_link_bound():
    async def scenario():
        uplink, loop, order = UplinkQueue(), asyncio.get_running_loop(), []

        async def body(name: str, seconds: float):
            turn = await uplink.turn(1000)
            order.append((name, loop.time()))
            await asyncio.sleep(seconds)
            turn.release()
            turn.release()  # idempotent: the body done, then the hop's finally

        await asyncio.gather(body("a", 2.0), body("b", 1.0), body("c", 1.0))
        bound = [uplink.link_bound(loop.time())]  # too few turns to tell
        await asyncio.gather(*(body(str(n), 1.0) for n in range(BUSY_TURNS)))
        bound.append(uplink.link_bound(loop.time()))  # back to back
        for n in range(BUSY_TURNS):  # a compute-bound stage: a moment's body, then a wait
            await body(str(n), 0.1)
            await asyncio.sleep(1.0)
        bound.append(uplink.link_bound(loop.time()))
        return order[:3], bound

    order, bound = vclock.run(scenario())
    assert order == [("a", 0.0), ("b", 2.0), ("c", 3.0)]
    assert bound == [False, True, False]


def test_a_body_that_stalls_lets_the_next_go_beside_it_after_its_hold():
    """A receiver that never acknowledges cannot hold our pipeline: the hold is a few
    times the body's time at the best rate we measured (or a fixed one before any)."""
    async def scenario():
        uplink = UplinkQueue()
        loop = asyncio.get_running_loop()
        await uplink.turn(1000)  # never released
        first = loop.time()
        await uplink.turn(1000)
        unmeasured = loop.time() - first
        uplink.note("QmFast", 250_000, 1.0)  # 250 kB/s
        started = loop.time()
        await uplink.turn(1_000_000)  # waits out the previous hold (unmeasured then)
        return unmeasured, uplink.hold_s(1_000_000), loop.time() - started

    unmeasured, hold_s, waited = vclock.run(scenario())
    assert unmeasured == UNMEASURED_HOLD_S
    assert hold_s == 12.0  # 3 x 4 s
    assert waited == UNMEASURED_HOLD_S


def test_the_rate_is_what_we_measured_lately_and_peers_that_left_are_forgotten():
    uplink = UplinkQueue()
    assert uplink.rate("QmA") is None and uplink.best_rate() is None and uplink.expected("QmA") is None
    for seconds in (1.0, 2.0, 4.0, 4.0):  # the last three count
        uplink.note("QmA", 1000, seconds)
    uplink.note("QmB", 1000, 0.0)  # no time: no sample
    assert uplink.rate("QmA") == (500 + 250 + 250) / 3 and uplink.rate("QmB") is None
    # a peer not measured among our last FRESH_BODIES counts as the best of our last LONG_BODIES
    assert uplink.expected("QmB") == 1000 == uplink.best_rate()
    for _ in range(FRESH_BODIES - 1):
        uplink.note("QmB", 100, 1.0)
    assert uplink.rate("QmA") == 1000 / 3
    uplink.note("QmB", 100, 1.0)
    assert uplink.rate("QmA") is None and uplink.expected("QmA") == 1000
    for _ in range(LONG_BODIES):
        uplink.note("QmB", 100, 1.0)
    assert uplink.best_rate() == 100
    uplink.keep_only({"QmA"})
    assert uplink.rate("QmB") is None


class NoProbes(random.Random):
    """random() never under PROBE_SHARE."""

    def random(self):
        return 0.99


def test_a_link_bound_hop_keeps_to_its_peer_unless_another_is_clearly_faster():
    uplink, sticky, rng = UplinkQueue(), StickyChoice(current="QmA"), NoProbes(0)
    uplink.note("QmA", 100, 1.0)
    uplink.note("QmB", 115, 1.0)
    assert sticky.choose(["QmA", "QmB"], uplink.expected, rng) == "QmA"  # 1.15x: not worth a move
    uplink.note("QmB", 160, 1.0)  # now 137.5 a second
    assert sticky.choose(["QmA", "QmB"], uplink.expected, rng) == "QmB" == sticky.current
    # ours slows: a peer never measured counts as the best we measured, and is tried
    uplink.note("QmB", 10, 1.0)
    uplink.note("QmB", 10, 1.0)
    assert uplink.expected("QmC") == uplink.best_rate() == 160
    assert sticky.choose(["QmB", "QmC"], uplink.expected, rng) == "QmC" == sticky.current
    # the current one at its cap of our hops: this one overflows, and we keep to ours
    assert sticky.choose(["QmA", "QmB"], uplink.expected, rng, at_cap=frozenset({"QmC"})) == "QmA"
    assert sticky.current == "QmC"
    # the current one not usable otherwise (banned, tried, gone): the fastest usable
    assert sticky.choose(["QmA", "QmB"], uplink.expected, rng) == "QmA" == sticky.current
    # nothing measured: all alike, the current one kept
    assert StickyChoice(current="QmB").choose(["QmA", "QmB"], UplinkQueue().expected, rng) == "QmB"


def test_link_bound_hops_probe_other_peers_now_and_then_without_moving_us():
    uplink, sticky, rng = UplinkQueue(), StickyChoice(current="QmA"), random.Random(1)
    picks = []
    for _ in range(4000):
        uplink.note("QmA", 100, 1.0)
        uplink.note("QmB", 10, 1.0)
        picks.append(sticky.choose(["QmA", "QmB"], uplink.expected, rng))
        assert sticky.current == "QmA"
    share = picks.count("QmB") / len(picks)
    assert abs(share - PROBE_SHARE / 2) < 0.01  # a probe picks among all, the slow one half the time


def _two_callers(hops: int, seeded: bool) -> list[bool]:
    """Two link-bound callers over two peers, each body at its link's rate shared by the
    callers sending to that peer's downlink at once; whether they were apart, per hop."""
    link = 250_000.0
    callers = {name: (PeerChooser(rng=random.Random(seed)), UplinkQueue())
               for name, seed in (("a", 1), ("b", 2))}
    if seeded:  # both on QmC, each body there at half the link; QmD measured slow once
        for chooser, uplink in callers.values():
            uplink.note("QmD", 1_000_000, 40.0)
            uplink.note("QmC", 1_000_000, 8.0)
            chooser.sticky.current = "QmC"
    peers, apart = [Candidate(p, 0.0, 0) for p in ("QmC", "QmD")], []
    for _ in range(hops):
        picks = {name: chooser.choose(peers, upload_rate=uplink.expected)
                 for name, (chooser, uplink) in callers.items()}
        for name, (_, uplink) in callers.items():
            sharing = sum(peer == picks[name] for peer in picks.values())
            uplink.note(picks[name], 1_000_000, 1_000_000 / (link / sharing))
        apart.append(picks["a"] != picks["b"])
    return apart


def test_two_link_bound_callers_settle_on_different_peers():
    """What the sticky choice is for: two callers whose bodies share a receiver's downlink
    each measure half the rate there and move until each has a peer of its own (a random
    choice per hop would put them together about half the time)."""
    apart = _two_callers(400, seeded=False)[100:]
    assert sum(apart) / len(apart) > 0.85  # the probes put them together now and then


def test_a_peer_measured_slow_once_is_tried_again():
    """Both callers on one peer, the other measured slow once: its figure goes stale, a
    probe finds it free, and the one that probed moves (a figure kept for good starved
    that peer for minutes in the test bed)."""
    apart = _two_callers(200, seeded=True)
    assert sum(apart[:5]) < 5 and sum(apart[100:]) / 100 > 0.85


def test_a_hop_that_is_not_link_bound_spreads_as_before():
    chooser = PeerChooser(rng=random.Random(3))
    picks = [chooser.choose([Candidate(p, 10.0, 0) for p in ("QmC", "QmD")]) for _ in range(400)]
    assert 150 < picks.count("QmC") < 250 and chooser.sticky.current is None
