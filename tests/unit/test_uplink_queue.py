"""Our bodies cross our uplink one at a time, and link-bound hops keep to the peer that
takes them fastest (train/uplink.py, routing/chooser.py)."""

import asyncio
import random

import vclock

from swarm_node.routing.chooser import Candidate, PeerChooser
from swarm_node.routing.sticky import MOVE_CHANCE, PROBE_SHARE, RESHUFFLE_HOPS, StickyChoice
from swarm_node.train.uplink import BUSY_BODIES, FRESH_BODIES, LONG_BODIES, UNMEASURED_HOLD_S, UplinkQueue


def test_link_bound_bodies_take_the_uplink_one_after_another():
    async def scenario():
        uplink, loop, order = UplinkQueue(link_bound=True), asyncio.get_running_loop(), []

        async def body(name: str, seconds: float):
            turn = await uplink.turn(1000)
            order.append((name, loop.time()))
            await asyncio.sleep(seconds)
            turn.release()
            turn.release()  # idempotent: the body done, then the hop's finally

        await asyncio.gather(body("a", 2.0), body("b", 1.0), body("c", 1.0))
        uplink.link_bound = False  # side by side again
        await asyncio.gather(body("d", 2.0), body("e", 1.0))
        return order

    assert vclock.run(scenario()) == [("a", 0.0), ("b", 2.0), ("c", 3.0), ("d", 4.0), ("e", 4.0)]


def _busy(uplink: UplinkQueue, body_s: float, gap_s: float, side_by_side: int = 1):
    """BUSY_BODIES bodies of ``body_s``, ``side_by_side`` at once, ``gap_s`` between."""
    async def scenario():
        loop = asyncio.get_running_loop()

        async def body():
            turn = await uplink.turn(1000)
            await asyncio.sleep(body_s)
            turn.release()
        for _ in range(BUSY_BODIES // side_by_side):
            await asyncio.gather(*(body() for _ in range(side_by_side)))
            await asyncio.sleep(gap_s)
        return uplink.busy_share(loop.time())
    return vclock.run(scenario())


def test_the_busy_share_counts_time_with_a_body_of_ours_on_the_uplink_once():
    assert _busy(UplinkQueue(), 3.0, 1.0) == 0.75
    assert _busy(UplinkQueue(), 3.0, 1.0, side_by_side=2) == 0.75  # two at once are busy once
    assert _busy(UplinkQueue(), 0.5, 1.5) == 0.25


def test_link_bound_takes_a_slow_pace_and_a_busy_uplink_and_holds_until_either_clearly_ends():
    uplink, now = UplinkQueue(), 1e6
    assert not uplink.judge(now, 0.1)  # the busy share not measured yet
    uplink.busy_share = lambda now: 0.9
    assert not uplink.judge(now, None)  # the pace not measured yet
    assert not uplink.judge(now, 1.0)  # compute-bound: the link keeps up
    assert uplink.judge(now, 0.3)
    assert uplink.judge(now, 0.7)  # between the edges: as it was
    assert not uplink.judge(now, 0.9)
    assert not uplink.judge(now, 0.7)
    uplink.busy_share = lambda now: 0.6  # a card on a home link: a slow next stage, our link two-thirds busy
    assert not uplink.judge(now, 0.3)
    uplink.busy_share = lambda now: 0.8
    assert uplink.judge(now, 0.3)
    uplink.busy_share = lambda now: 0.6
    assert uplink.judge(now, 0.3)
    uplink.busy_share = lambda now: 0.4
    assert not uplink.judge(now, 0.3)


def test_a_body_that_stalls_lets_the_next_go_beside_it_after_its_hold():
    """A receiver that never acknowledges cannot hold our pipeline: the hold is a few
    times the body's time at the best rate we measured (or a fixed one before any)."""
    async def scenario():
        uplink = UplinkQueue(link_bound=True)
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


def test_a_peer_is_crowded_when_our_bodies_there_move_at_about_half_our_rate_alone():
    """Measured in the test bed (2 Mbit/s, 1 MB bodies): 90-140 kB/s with two callers on
    one receiver, 130-245 kB/s alone; a pair that met often leaves few bodies alone in our
    history, so our usual rate is its upper tail, not its middle."""
    uplink = UplinkQueue(link_bound=True)
    for _ in range(FRESH_BODIES - 2):
        uplink.note("QmC", 1000, 1 / 240)
    assert not uplink.crowded("QmD")  # too little history to tell
    for kb_s in [110, 120, 100, 130, 95, 125, 105, 115] * 4:  # mostly met another caller
        uplink.note("QmD", 1000 * kb_s, 1.0)
    assert uplink.crowded("QmD")
    for kb_s in (170, 150, 190):  # alone again, our uplink busy now and then
        uplink.note("QmD", 1000 * kb_s, 1.0)
    assert not uplink.crowded("QmD") and not uplink.crowded("QmGone")


def test_the_rate_is_what_we_measured_lately_and_peers_that_left_are_forgotten():
    uplink = UplinkQueue(link_bound=True)
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
    """random() never under PROBE_SHARE, always under MOVE_CHANCE."""

    def random(self):
        return (PROBE_SHARE + MOVE_CHANCE) / 2


def test_a_link_bound_hop_keeps_to_its_peer_unless_another_is_clearly_faster():
    uplink, sticky, rng = UplinkQueue(link_bound=True), StickyChoice(current="QmA"), NoProbes(0)
    uplink.note("QmA", 100, 1.0)
    uplink.note("QmB", 115, 1.0)
    assert sticky.choose(["QmA", "QmB"], uplink, rng) == "QmA"  # 1.15x: not worth a move
    uplink.note("QmB", 160, 1.0)  # now 137.5 a second
    assert sticky.choose(["QmA", "QmB"], uplink, rng) == "QmB" == sticky.current
    # ours slows: a peer never measured counts as the best we measured, and is tried
    uplink.note("QmB", 10, 1.0)
    uplink.note("QmB", 10, 1.0)
    assert uplink.expected("QmC") == uplink.best_rate() == 160
    assert sticky.choose(["QmB", "QmC"], uplink, rng) == "QmC" == sticky.current
    # the current one at its cap of our hops: this one overflows, and we keep to ours
    assert sticky.choose(["QmA", "QmB"], uplink, rng, at_cap=frozenset({"QmC"})) == "QmA"
    assert sticky.current == "QmC"
    # the current one not usable otherwise (banned, tried, gone): the fastest usable
    assert sticky.choose(["QmA", "QmB"], uplink, rng) == "QmA" == sticky.current
    # nothing measured: all alike, the current one kept
    assert StickyChoice(current="QmB").choose(["QmA", "QmB"], UplinkQueue(), rng) == "QmB"


def test_link_bound_hops_probe_other_peers_now_and_then_without_moving_us():
    uplink, sticky, rng = UplinkQueue(link_bound=True), StickyChoice(current="QmA"), random.Random(1)
    picks = []
    for _ in range(4000):
        uplink.note("QmA", 100, 1.0)
        uplink.note("QmB", 10, 1.0)
        pick = sticky.choose(["QmA", "QmB"], uplink, rng)
        if sticky.hops % RESHUFFLE_HOPS > 16:  # a fresh draw onto the slow one is left soon after
            picks.append(pick)
            assert sticky.current == "QmA"
    share = picks.count("QmB") / len(picks)
    assert abs(share - PROBE_SHARE / 2) < 0.01  # a probe picks among all, the slow one half the time


def _two_callers(hops: int, seeded: str | None, seed: int = 0) -> list[bool]:
    """Two link-bound callers over two peers, each body at its link's rate shared by the
    callers sending to that peer's downlink at once; whether they were apart, per hop."""
    link = 250_000.0
    callers = {name: (PeerChooser(rng=random.Random(seed * 10 + n)), UplinkQueue(link_bound=True))
               for name, n in (("a", 1), ("b", 2))}
    for chooser, uplink in callers.values():
        if seeded == "slow once":  # both on QmC, each body there at half the link; QmD measured slow once
            uplink.note("QmD", 1_000_000, 40.0)
            uplink.note("QmC", 1_000_000, 8.0)
        elif seeded == "lockstep":  # both were on QmD together, then on QmC together
            uplink.note("QmC", 1_000_000, 4.0)
            for peer in ("QmD",) * 4 + ("QmC",) * 4:
                uplink.note(peer, 1_000_000, 8.0)
        chooser.sticky.current = "QmC" if seeded else None
    peers, apart = [Candidate(p, 0.0, 0) for p in ("QmC", "QmD")], []
    for _ in range(hops):
        picks = {name: chooser.choose(peers, body_rates=uplink)
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
    apart = _two_callers(400, seeded=None)[100:]
    assert sum(apart) / len(apart) > 0.85  # the probes put them together now and then


def test_a_peer_measured_slow_once_is_tried_again():
    """Both callers on one peer, the other measured slow once: its figure goes stale, a
    probe finds it free, and the one that probed moves (a figure kept for good starved
    that peer for minutes in the test bed)."""
    apart = _two_callers(200, seeded="slow once")
    assert sum(apart[:5]) < 5 and sum(apart[100:]) / 100 > 0.85


def test_two_callers_with_the_same_history_part_soon():
    """Both callers measured both peers at half the link together: each figure goes stale
    for both at once, so callers that always moved on it moved together (in the test bed
    two stage-0 peers shared one receiver for a minute, then the other for 40 s). Moving
    on MOVE_CHANCE of the hops it would parts them within a few hops (always moving: apart
    on 40 % of the first 20 hops, 86 % of the next 40)."""
    runs = [_two_callers(60, seeded="lockstep", seed=seed) for seed in range(40)]
    assert sum(sum(apart[:20]) for apart in runs) / (40 * 20) > 0.5
    assert sum(sum(apart[20:]) for apart in runs) / (40 * 40) > 0.92


def test_a_hop_that_is_not_link_bound_spreads_as_before():
    chooser = PeerChooser(rng=random.Random(3))
    picks = [chooser.choose([Candidate(p, 10.0, 0) for p in ("QmC", "QmD")]) for _ in range(400)]
    assert 150 < picks.count("QmC") < 250 and chooser.sticky.current is None


def test_a_lone_caller_still_spreads_its_hops_over_a_run():
    """Routing stays random over a run (docs/ALGORITHM.md 4): a caller alone, both peers
    alike, draws its peer afresh every RESHUFFLE_HOPS hops instead of keeping one for good."""
    chooser, uplink = PeerChooser(rng=random.Random(5)), UplinkQueue(link_bound=True)
    peers, picks = [Candidate(p, 0.0, 0) for p in ("QmC", "QmD")], []
    for _ in range(RESHUFFLE_HOPS * 40):
        picks.append(chooser.choose(peers, body_rates=uplink))
        uplink.note(picks[-1], 250_000, 1.0)
    assert 0.3 < picks.count("QmC") / len(picks) < 0.7
