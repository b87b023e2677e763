"""The pairing rule in-process: many coordinators on a fake network whose calls go
straight to the other coordinator's handler (with random delivery delays).

Everything runs on the virtual clock of tests/vclock.py: delivery delays, a dead peer's
time-out and the round deadlines take no real time, and the outcome of a seed does not
depend on how loaded the machine is."""

import asyncio
import random

import pytest
import vclock

from swarm_node.errors import PeerTimeout
from swarm_node.gossip.pairing import ETA_CLAIMS, PairingCoordinator, Refused


class FakeNetwork:
    """Coordinators whose calls go straight to each other's handlers, each message with a
    random delivery delay; a payload takes ``payload_s`` more each way (a large stage)."""

    def __init__(self, n: int, seed: int, *, dead: frozenset[str] = frozenset(), round_timeout_s: float = 1.0,
                 payload_s: float = 0.0, tie_break: bool = True):
        self.rng = random.Random(seed)
        self.names = [f"peer{i}" for i in range(n)]
        self.dead = dead
        self.payload_s = payload_s
        self.proposals = 0
        self.payloads = 0
        self.nodes = {name: PairingCoordinator(round_timeout_s=round_timeout_s,
                                               request_timeout_s=0.3 + 2 * payload_s, propose_timeout_s=0.1,
                                               own_id=name if tie_break else "", backoff_s=(0.001, 0.01),
                                               rng=random.Random(self.rng.random())) for name in self.names}

    async def _hop(self, extra_s: float = 0.0) -> None:
        await asyncio.sleep(self.rng.uniform(0, 0.003) + extra_s)

    async def propose(self, sender: str, peer: str, timeout: float) -> None:
        self.proposals += 1
        await self._hop()
        if peer in self.dead:
            await asyncio.sleep(timeout)
            raise PeerTimeout("dead")
        try:
            self.nodes[peer].on_propose(sender)  # may raise Refused
        finally:
            await self._hop()  # the answer travels back, a refusal too

    async def send(self, sender: str, peer: str, payload, timeout: float):
        self.payloads += 1
        await self._hop(self.payload_s)
        node = self.nodes[peer]
        try:
            node.claim(sender)  # may raise Refused
            assert node.may_fetch(sender)  # the fetch of its payload, beside ours, is let through
            node.complete(sender, payload)
            assert node.may_fetch(sender)  # also once the pair is made
            return f"payload-of-{peer}"
        finally:
            await self._hop(self.payload_s)

    async def one(self, name: str, start_jitter_s: float):
        await asyncio.sleep(self.rng.uniform(0, start_jitter_s))
        return await self.nodes[name].run_round(
            0, f"payload-of-{name}",
            candidates=lambda: [(p, self.nodes[p].state.value == "seeking") for p in self.names if p != name],
            propose=lambda peer, timeout: self.propose(name, peer, timeout),
            send=lambda peer, payload, timeout: self.send(name, peer, payload, timeout))

    async def run(self, start_jitter_s: float = 0.02):
        live = [name for name in self.names if name not in self.dead]
        results = await asyncio.gather(*(self.one(name, start_jitter_s) for name in live))
        return dict(zip(live, results))


async def run_swarm(n: int, seed: int, *, dead: frozenset[str] = frozenset(), start_jitter_s: float = 0.02,
                    round_timeout_s: float = 1.0):
    return await FakeNetwork(n, seed, dead=dead, round_timeout_s=round_timeout_s).run(start_jitter_s)


def assert_mutual(results: dict) -> None:
    for name, result in results.items():
        if result is not None:
            partner = results[result.partner]
            assert partner is not None and partner.partner == name, f"{name} -> {result.partner} not mutual"
            assert result.payload == f"payload-of-{result.partner}"
            assert partner.initiated != result.initiated


@pytest.mark.parametrize("n,seed", [(2, 0), (4, 1), (5, 2), (8, 3), (7, 4), (16, 5)])
def test_pairs_are_mutual_and_everyone_but_an_odd_one_pairs(n, seed):
    results = vclock.run(run_swarm(n, seed))
    assert_mutual(results)
    unpaired = [name for name, r in results.items() if r is None]
    assert len(unpaired) == n % 2


@pytest.mark.parametrize("n,seed", [(4, 11), (8, 12), (16, 13)])
def test_payloads_move_only_between_agreed_partners(n, seed):
    """Refusals cost a proposal, never a payload: with payloads 30x slower than a proposal
    (a large stage) everyone still pairs, and each pair moves its payload exactly once."""
    net = FakeNetwork(n, seed, payload_s=0.1, round_timeout_s=2.0)
    results = vclock.run(net.run(start_jitter_s=0.0))
    assert_mutual(results)
    assert all(r is not None for r in results.values())
    assert net.payloads == n // 2


@pytest.mark.parametrize("tie_break", [True, False])
def test_crossed_proposals_pair_at_once(tie_break):
    """Two peers reaching the boundary together propose to each other: the larger id
    accepts, so two proposals make the pair. Without the tie-break both are refused and
    they need back-offs and more proposals, which this test shows by failing."""
    counts = []
    for seed in range(10):
        net = FakeNetwork(2, seed, tie_break=tie_break)
        net.rng.uniform = lambda a, b: 0.001  # both start together, every hop the same
        results = vclock.run(net.run(start_jitter_s=0.0))
        assert_mutual(results)
        counts.append(net.proposals)
        if tie_break and net.proposals == 2:  # the larger id accepted, so the smaller sent the payload
            assert results["peer0"].initiated and not results["peer1"].initiated
    assert (max(counts) == 2) == tie_break


def test_pairing_differs_between_rounds():
    partners = {frozenset((a, r.partner)) for seed in range(6)
                for a, r in vclock.run(run_swarm(4, seed)).items() if r}
    assert len(partners) > 2


def test_a_dead_peer_costs_at_most_the_round_deadline():
    async def timed():
        results = await run_swarm(4, 7, dead=frozenset({"peer3"}), round_timeout_s=1.0)
        return results, asyncio.get_running_loop().time()

    loop_results, ended_at = vclock.run(timed())
    paired = [r for r in loop_results.values() if r is not None]
    assert len(paired) == 2  # two of the three live peers pair, the third goes local-only
    assert all(r.partner != "peer3" for r in paired)
    # Virtual time: the last start (jitter) + the deadline + an exchange begun just before it (4 hops).
    assert ended_at <= 0.02 + 1.0 + 4 * 0.003


def test_refuses_when_not_seeking():
    node = PairingCoordinator(round_timeout_s=1, request_timeout_s=1)
    with pytest.raises(Refused, match="not-ready"):
        node.on_propose("x")
    with pytest.raises(Refused, match="no-reservation"):
        node.claim("x")


async def _seeking_alone(node: PairingCoordinator):
    """``node`` seeking with no candidates of its own: it only answers proposals."""
    task = asyncio.create_task(node.run_round(0, "mine", candidates=list, propose=None, send=None,
                                              expect_request=True))
    await node.seeking.wait()
    return task


def test_a_reservation_admits_only_its_peer_and_lapses_when_the_payload_never_comes():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=0.2, propose_timeout_s=0.1)
        task = await _seeking_alone(node)
        loop = asyncio.get_running_loop()
        node.on_propose("ghost")  # accepted, then the proposer dies
        reserved_at = loop.time()
        with pytest.raises(Refused, match="busy"):
            node.on_propose("other")
        with pytest.raises(Refused, match="no-reservation"):
            node.claim("other")
        async with asyncio.timeout(5):  # (virtual time: a reservation that never lapses fails here at once)
            while node.state.value != "seeking":  # the lapse, after propose + request timeouts
                await asyncio.sleep(0.02)
        assert 0.1 + 0.2 - 1e-9 <= loop.time() - reserved_at <= 0.1 + 0.2 + 0.02 + 1e-9
        with pytest.raises(Refused, match="no-reservation"):
            node.claim("ghost")
        assert not node.may_fetch("other") and not node.may_fetch("ghost")
        node.on_propose("other")
        assert node.may_fetch("other")
        node.claim("other")
        node.complete("other", "theirs")
        assert node.may_fetch("other") and not node.may_fetch("ghost")
        return await task

    result = vclock.run(scenario())
    assert (result.partner, result.payload, result.initiated) == ("other", "theirs", False)


def test_a_bad_payload_releases_the_reservation():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=5.0)
        task = await _seeking_alone(node)
        async def rejected():
            raise ValueError("the node's checks rejected it")

        async def fine():
            return "fine"

        node.on_propose("bad")
        with pytest.raises(ValueError):
            await node.answer("bad", rejected)
        node.on_propose("good")
        assert not node.may_fetch("bad")
        await node.answer("good", fine)
        return await task

    assert vclock.run(scenario()).partner == "good"


def test_a_reserved_node_holds_its_round_open_past_the_deadline():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=0.1, request_timeout_s=5.0)
        task = await _seeking_alone(node)
        node.on_propose("slow")
        await asyncio.sleep(0.3)  # the payload is still on its way when the round deadline passes
        assert not task.done()
        node.claim("slow")
        node.complete("slow", "late")
        return await task

    assert vclock.run(scenario()).payload == "late"


def test_a_cancelled_round_ends_even_when_cancelled_as_it_wakes():
    """Shutdown cancels the round. If the cancellation lands in the same loop turn as a
    wake-up (here a released reservation), it must still end the round at once;
    ``asyncio.wait_for`` on Python 3.11 swallows it, and the round ran on to its deadline."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=30.0, request_timeout_s=30.0)
        task = await _seeking_alone(node)
        node.on_propose("peer")
        node.claim("peer")
        for _ in range(2):  # these loop turns put the round where 3.11's wait_for loses the cancellation
            await asyncio.sleep(0)
        node.release("peer")
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        return task.cancelled()

    assert vclock.run(scenario())


def test_the_reserved_peer_asking_again_is_told_yes_again_and_others_busy():
    """A proposal whose answer was lost to a stream reset is sent again: the peer we
    reserved ourselves for must get yes again, not busy."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=1.0, request_timeout_s=1.0, own_id="QmB")
        rounding = asyncio.create_task(node.run_round(0, "ours", candidates=list, propose=None, send=None,
                                                      expect_request=True))
        await node.seeking.wait()
        node.on_propose("QmA")
        node.on_propose("QmA")  # asked again: still yes
        with pytest.raises(Refused, match="busy"):
            node.on_propose("QmC")
        rounding.cancel()
        await asyncio.gather(rounding, return_exceptions=True)

    vclock.run(scenario())


def test_a_round_opened_early_for_a_proposer_starts_reserved_for_it():
    """Rule 7: a proposal that opens our round early gets the round, even though the round,
    once open, would have proposed elsewhere in the same loop turn."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=5.0)
        proposed_to = []

        async def propose(peer, timeout):
            proposed_to.append(peer)

        async def fine():
            return "theirs"

        node.hold_for("puller")
        task = asyncio.create_task(node.run_round(0, "mine", candidates=lambda: [("elsewhere", 0)],
                                                  propose=propose, send=None, expect_request=True))
        await node.seeking.wait()
        node.on_propose("puller")  # its proposal, answered once the round is open: yes
        node.drop_hold("puller")  # what the handler does on its way out: the hold is spent already
        with pytest.raises(Refused, match="busy"):
            node.on_propose("other")
        await node.answer("puller", fine)
        return await task, proposed_to

    result, proposed_to = vclock.run(scenario())
    assert (result.partner, result.initiated, proposed_to) == ("puller", False, [])


def test_a_dropped_hold_leaves_the_round_seeking():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=5.0)
        node.hold_for("gone")
        node.drop_hold("gone")  # our round did not open in time: the proposer was told not-ready
        task = await _seeking_alone(node)
        with pytest.raises(Refused, match="no-reservation"):
            node.claim("gone")
        node.on_propose("other")
        await node.answer("other", lambda: asyncio.sleep(0, "theirs"))
        return await task

    assert vclock.run(scenario()).partner == "other"


@pytest.mark.parametrize("seed", range(8))
def test_a_peer_that_says_when_it_accepts_is_asked_then_first_and_believed_a_few_times(seed):
    """Rule 4: "not-ready, in 1 s" keeps the peer out of our choices until then; then it
    is asked before the others; a peer that says "later" every time is believed
    ETA_CLAIMS times a round; meanwhile we wait open to proposals."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=6.0, request_timeout_s=5.0, backoff_s=(0.01, 0.02),
                                  rng=random.Random(seed))
        loop = asyncio.get_running_loop()
        asked = []

        async def propose(peer, timeout):
            asked.append((peer, loop.time()))
            raise Refused("not-ready", ready_in_s=1.0 if peer == "later" else None)

        candidates = [("later", 0), ("other", 0)]
        return await node.run_round(0, "mine", candidates=lambda: candidates, propose=propose,
                                    send=None), asked

    result, asked = vclock.run(scenario())
    assert result is None
    later = [at for peer, at in asked if peer == "later"]
    assert len(later) == 1 + ETA_CLAIMS  # then no more this round
    # when it said (a back-off's length late)
    assert all(1.0 - 1e-9 <= b - a <= 1.0 + 0.05 for a, b in zip(later, later[1:]))
    assert all(peer == "other" for peer, at in asked if later[0] < at < later[1])


def test_an_eta_wait_still_accepts_proposals():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=10.0, request_timeout_s=5.0)

        async def propose(peer, timeout):
            raise Refused("not-ready", ready_in_s=8.0)

        task = asyncio.create_task(node.run_round(0, "mine", candidates=lambda: [("later", 0)],
                                                  propose=propose, send=None))
        await asyncio.sleep(1.0)
        assert node.state.value == "seeking"
        node.on_propose("caller")
        await node.answer("caller", lambda: asyncio.sleep(0, "theirs"))
        return await task

    assert vclock.run(scenario()).partner == "caller"


def test_a_hold_whose_proposer_was_never_answered_is_released():
    """The handler that opened our round early was cut short before it said yes: the
    round does not wait out a reservation its proposer never heard of."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=60.0)
        node.hold_for("cut")
        task = await _seeking_alone(node)
        assert node.may_fetch("cut")  # reserved for it by the hold
        node.drop_hold("cut")  # the handler's way out, with no on_propose before it
        assert node.state.value == "seeking" and not node.may_fetch("cut")
        node.on_propose("other")
        node.drop_hold("other")  # nothing held for it: a no-op
        await node.answer("other", lambda: asyncio.sleep(0, "theirs"))
        return await task

    assert vclock.run(scenario()).partner == "other"


def test_after_a_refusal_that_says_when_the_next_peer_is_asked_at_once():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=3.0, request_timeout_s=5.0, backoff_s=(1.0, 1.0),
                                  rng=random.Random(0))
        loop = asyncio.get_running_loop()
        asked = []

        async def propose(peer, timeout):
            asked.append((peer, loop.time()))
            raise Refused("not-ready", ready_in_s=10.0 if not asked[1:] else None)

        await node.run_round(0, "mine", candidates=lambda: [("a", 0), ("b", 0)], propose=propose, send=None)
        return asked

    asked = vclock.run(scenario())
    assert asked[1][1] == asked[0][1] and asked[1][0] != asked[0][0]  # no back-off after "later"
    assert asked[2][1] - asked[1][1] >= 1.0  # a plain not-ready still backs off


def test_a_withdrawn_proposal_frees_the_reservation_at_once():
    """The proposer took its proposal back (its answer came too late, or it stops): the
    round seeks again at once instead of waiting out the reservation (35 s in a node),
    and pairs with the next proposer. A payload already claimed is not given up."""
    async def scenario():
        node = PairingCoordinator(round_timeout_s=60.0, request_timeout_s=60.0)
        task = await _seeking_alone(node)
        loop = asyncio.get_running_loop()
        node.on_propose("gone")
        assert not node.withdrawn("someone-else")  # only the reserved peer can free its reservation
        assert node.may_fetch("gone")
        withdrawn_at = loop.time()
        assert node.withdrawn("gone")
        assert node.state.value == "seeking" and not node.may_fetch("gone")
        node.on_propose("next")
        node.claim("next")
        assert not node.withdrawn("next")  # its payload is in: the exchange goes on
        node.complete("next", "theirs")
        result = await task
        return result, loop.time() - withdrawn_at

    result, waited_s = vclock.run(scenario())
    assert result.partner == "next" and waited_s < 1.0


def test_a_withdrawal_drops_a_hold_and_an_unconfirmed_reservation():
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=60.0)
        node.hold_for("early")
        node.withdrawn("early")  # before the round opened: it opens seeking, not reserved
        task = await _seeking_alone(node)
        assert not node.may_fetch("early")
        node.hold_for("late")  # no effect on an open round
        assert node.state.value == "seeking"
        task.cancel()
        node2 = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=60.0)
        node2.hold_for("cut")
        task2 = await _seeking_alone(node2)
        assert node2.may_fetch("cut")
        assert node2.withdrawn("cut")  # opened reserved for it, its yes not yet sent
        node2.drop_hold("cut")  # the proposal's handler ends after: nothing left to release
        assert node2.state.value == "seeking"
        task2.cancel()

    vclock.run(scenario())


@pytest.mark.parametrize("cut_at", ["propose", "send"])
def test_a_proposal_or_payload_cut_by_stopping_names_the_peer_to_withdraw_from(cut_at):
    async def scenario():
        node = PairingCoordinator(round_timeout_s=5.0, request_timeout_s=5.0, propose_timeout_s=5.0)
        reached = asyncio.Event()

        async def propose(peer, timeout):
            if cut_at == "propose":
                reached.set()
                await asyncio.sleep(3600)

        async def send(peer, payload, timeout):
            reached.set()
            await asyncio.sleep(3600)

        task = asyncio.create_task(node.run_round(0, "mine", candidates=lambda: [("partner", 2)],
                                                  propose=propose, send=send))
        await reached.wait()
        assert node.abandoned is None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return node.abandoned

    assert vclock.run(scenario()) == "partner"
