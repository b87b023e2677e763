"""Two nodes' outer exchanges joined back to back: the round of the run's codec moves the
bytes the codec says (the default at most a quarter of a 16-bit round, the first one
too), and an
overlapped round lets the inner steps go on while the partner's payload is on its way."""

import asyncio
import collections
import dataclasses

import pytest
import torch
import vclock
from parts import StageParts, record

from swarm_node.data.spec import DataSpec
from swarm_node.errors import StreamClosed
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame

SPEC = RunSpec(run_id="overlap", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))
LINK_S = 3.0  # each payload spends this long on the wire (virtual time)


class Link:
    """Requests go straight to the other node's handlers; bytes move at ``bytes_per_s``
    (ours going in on OUTER, the partner's coming back on OUTER_FETCH), so that a whole
    payload takes LINK_S and a part its share of it."""

    def __init__(self, bytes_per_s: float, lose_a_phi_answer: bool = False):
        self.exchanges, self.bytes = {}, collections.Counter()
        self.bytes_per_s = bytes_per_s
        # the first phi's verdict is lost to a reset, once delivered
        self.lose_a_phi_answer = lose_a_phi_answer
        self.answers_lost = 0

    def transport(self, own_id: str):
        link = self

        class Transport:
            async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
                link.bytes[protocol] += len(payload)
                async with asyncio.timeout(timeout_s):
                    if protocol == protocols.OUTER:
                        await asyncio.sleep(len(payload) / link.bytes_per_s)
                    other = link.exchanges[peer]
                    handler = {protocols.PAIR: other.handle_propose,
                               protocols.OUTER: other.payloads.handle_outer,
                               protocols.OUTER_FETCH: other.payloads.handle_fetch}[protocol]
                    answer = await handler(own_id, payload)
                    if (protocol == protocols.OUTER and link.lose_a_phi_answer
                            and decode_frame(payload)[0].get("part") == "phi"):
                        link.lose_a_phi_answer = False
                        link.answers_lost += 1
                        raise StreamClosed("stream closed mid-frame")
                    if protocol == protocols.OUTER_FETCH:
                        await asyncio.sleep(len(answer) / link.bytes_per_s)
                link.bytes[protocol] += len(answer)
                return answer

        return Transport()


def trained(seed: int, spec: RunSpec) -> StageWorker:
    worker = StageWorker(spec, 1, 16)
    g = torch.Generator().manual_seed(seed)
    for _ in range(spec.method.inner_steps):
        worker.forward_backward_last(torch.randn(4, 16, worker.model_config.hidden_size, generator=g),
                                     torch.randint(0, 16, (4, 16), generator=g))
        worker.step()
    return worker


@dataclasses.dataclass
class Round:
    stages: list[StageParts]
    sent: collections.Counter  # bytes by protocol, both ways
    steps_open: list[bool]  # whether the gate let steps through while the payload was on the wire
    # whether the partner's Delta had moved the steps three quarters into the exchange
    delta_landed: list[bool]
    outcomes: list  # each node's RoundOutcome
    answers_lost: int = 0  # verdicts the link lost after delivering the request


def one_round(codec: str, blocking: bool = False, both_at_once: bool = True,
              lose_a_phi_answer: bool = False) -> Round:
    spec = dataclasses.replace(SPEC, outer_codec=codec)
    ids = ["QmAaa", "QmBbb"]
    stages = [StageParts(spec, trained(i, spec), config=NodeConfig(round_timeout_s=30.0))
              for i in range(2)]
    worker = stages[0].worker
    link = Link(sum(p.numel() for p in worker.params) * worker.codec.bytes_per_parameter() / LINK_S,
                lose_a_phi_answer)
    steps_open, delta_landed, outcomes = [], [], []

    async def both():
        exchanges = []
        for own, other, stage in zip(ids, reversed(ids), stages):
            stage.transport = link.transport(own)
            stage.membership.peers = {1: {other: record(1, spec)}}
            stage.guard.reached(other)  # a peer we talked to before: verified
            exchange = stage.exchange(own_id=own, overlapped=not blocking, both_at_once=both_at_once)
            link.exchanges[own] = exchange
            exchanges.append(exchange)
        for stage in stages:
            stage.gate.note_due(True)
        rounds = [asyncio.create_task(e.run_round()) for e in exchanges]
        await asyncio.sleep(LINK_S / 2)
        steps_open.extend(stage.gate.idle.is_set() for stage in stages)
        await asyncio.sleep(LINK_S / 4)
        delta_landed.extend(
            stage.worker.open is not None and stage.worker.open.delta_landed for stage in stages
        )
        outcomes.extend(await asyncio.gather(*rounds))

    vclock.run(both())
    return Round(stages, link.bytes, steps_open, delta_landed, outcomes, link.answers_lost)


@pytest.mark.parametrize("codec", ["fp16", "int8", "near4-3"])
def test_a_round_pairs_and_moves_the_bytes_its_codec_says(codec):
    done = one_round(codec)
    stages, sent = done.stages, done.sent
    assert all(s.stats.rounds_with_partner == 1 and s.worker.outer_round == 1 for s in stages)
    numel = sum(p.numel() for p in stages[0].worker.params)
    per_parameter = payload_bytes(sent) / (2 * numel)  # each of the two sent its payload once
    assert per_parameter == pytest.approx(stages[0].worker.codec.bytes_per_parameter(), rel=0.02)


def test_each_partners_delta_moves_the_others_steps_halfway_through_a_16_bit_exchange():
    """Delta goes ahead of phi both ways (ALGORITHM.md 3.1): three quarters into the
    exchange both nodes' steps already stand on the pair's Delta step; the caller's
    critical path shows its partner's Delta in at half the exchange. A blocking round
    has no steps to move."""
    done = one_round("fp16")
    assert done.delta_landed == [True, True]
    caller = next(o for o in done.outcomes if o.delta_in_s is not None)
    assert caller.delta_in_s == pytest.approx(LINK_S / 2, rel=0.05) and caller.exchange_s > 0.9 * LINK_S
    assert one_round("fp16", blocking=True).delta_landed == [False, False]


def test_a_phi_whose_verdict_a_reset_lost_is_sent_again_and_both_sides_pair():
    """The partner took our phi and paired; its answer was lost to a stream reset. Asked
    again, it says yes again (without taking the phi twice), so both pair, and end
    where a round without the reset ends."""
    lost, clean = one_round("fp16", lose_a_phi_answer=True), one_round("fp16")
    assert lost.answers_lost == 1 and clean.answers_lost == 0
    for done in (lost, clean):
        assert [s.stats.rounds_with_partner for s in done.stages] == [1, 1]
    for a, b in zip(lost.stages, clean.stages):
        assert all(torch.equal(x, y) for x, y in zip(a.worker.params, b.worker.params))


def payload_bytes(sent: collections.Counter) -> int:
    return sent[protocols.OUTER] + sent[protocols.OUTER_FETCH]


def test_the_default_round_sends_at_most_a_quarter_of_a_16_bit_one():
    default = payload_bytes(one_round(SPEC.outer_codec).sent)
    assert default <= 0.25 * payload_bytes(one_round("fp16").sent)


def test_both_payloads_move_at_once():
    """The caller's payload goes out while the partner's comes in: the exchange takes
    one payload's time on the wire, not two (as it did before, and does with
    --one-payload-at-a-time). Both sides see it, and count it in their critical path."""
    at_once, one_by_one = one_round("fp16"), one_round("fp16", both_at_once=False)
    for done in (at_once, one_by_one):
        assert all(s.stats.rounds_with_partner == 1 and s.stats.round_exchanges == 1 for s in done.stages)
    assert max(o.exchange_s for o in at_once.outcomes) < 1.5 * LINK_S, at_once.outcomes
    # the caller waits for both, one after the other (the callee has the caller's sooner)
    assert max(o.exchange_s for o in one_by_one.outcomes) >= 2 * LINK_S, one_by_one.outcomes
    for stage, outcome in zip(at_once.stages, at_once.outcomes):
        parts = (
            outcome.prepare_s
            + (outcome.partner_at - outcome.started_at)
            + outcome.exchange_s
            + outcome.close_s
        )
        assert parts == pytest.approx(outcome.seconds) and stage.stats.round_s == pytest.approx(
            outcome.seconds
        )


def test_an_overlapped_round_lets_the_steps_go_on_and_a_blocking_one_holds_them():
    overlapped = one_round("fp16").steps_open
    blocking = one_round("fp16", blocking=True).steps_open
    assert overlapped == [True, True] and blocking == [False, False]


@dataclasses.dataclass
class Rounds:
    outcomes: list[list]  # per node, its RoundOutcome of every round
    wall_s: float  # virtual time until both nodes had done every round


def rounds_on_a_slow_link(steps_s: float | list[float], rounds: int = 4, wait_first: bool = True,
                          gate_holds_steps: bool = True) -> Rounds:
    """Two nodes that run their rounds as a node does, their H inner steps taking
    ``steps_s`` (or, round by round, ``steps_s[k]``) while the gate is open, on a link
    where their fp16 exchange takes LINK_S. ``wait_first=False``: the node as it was,
    every wait at the next boundary."""
    step_times = steps_s if isinstance(steps_s, list) else [steps_s] * (rounds + 1)
    spec = dataclasses.replace(SPEC, outer_codec="fp16")
    ids = ["QmAaa", "QmBbb"]
    stages = [StageParts(spec, trained(i, spec), config=NodeConfig(round_timeout_s=30.0)) for i in range(2)]
    worker = stages[0].worker
    link = Link(sum(p.numel() for p in worker.params) * worker.codec.bytes_per_parameter() / LINK_S)

    async def node(exchange, gate):
        async def steps():
            for step_s in step_times:
                await gate.idle.wait()
                await asyncio.sleep(step_s)
                gate.note_due(True)

        stepping = asyncio.create_task(steps())
        done = []
        try:
            for _ in range(rounds):
                await gate.next_round()
                try:
                    done.append(await exchange.run_round())
                finally:
                    gate.round_over()
        finally:
            stepping.cancel()
        return done

    async def both():
        exchanges = []
        for own, other, stage in zip(ids, reversed(ids), stages):
            stage.transport = link.transport(own)
            stage.membership.peers = {1: {other: record(1, spec)}}
            stage.guard.reached(other)
            exchange = link.exchanges[own] = stage.exchange(own_id=own)
            if not wait_first:
                exchange._wait_first_s = lambda: 0.0
            exchange.gate_holds_steps = gate_holds_steps
            exchanges.append(exchange)
        for stage in stages:
            stage.gate.note_due(True)
        started = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(*(node(e, s.gate) for e, s in zip(exchanges, stages)))
        return outcomes, asyncio.get_running_loop().time() - started

    outcomes, wall_s = vclock.run(both())
    return Rounds(outcomes, wall_s)


def test_an_exchange_outlasting_its_steps_has_every_next_rounds_steps_wait_first_for_the_delta():
    """The exchange takes LINK_S, the round's steps a quarter of it: the steps stand
    3/4 LINK_S a round either way. From the second round on they stand first, until the
    partner's Delta is in (half of LINK_S), and take the round's steps from the pair's
    Delta step (ALGORITHM.md 3.1), every round, not every other one; the rounds take
    the time they took with every wait at the boundary."""
    first, boundary = rounds_on_a_slow_link(LINK_S / 4), rounds_on_a_slow_link(LINK_S / 4, wait_first=False)
    for outcomes in first.outcomes:
        assert all(o.partners for o in outcomes)
        assert outcomes[0].waited_first_s == 0
        assert all(LINK_S / 2 - 0.1 < o.waited_first_s < LINK_S / 2 + 0.2 for o in outcomes[1:]), outcomes
    assert all(o.waited_first_s == 0 for outcomes in boundary.outcomes for o in outcomes)
    assert first.wall_s == pytest.approx(boundary.wall_s, rel=0.02)


def test_the_wait_first_is_capped_by_what_the_last_exchange_overran():
    """The steps take 7/8 of LINK_S: they stand 1/8 a round, and wait first no longer
    than that for a Delta that needs half of LINK_S: the wait is moved, never made
    longer."""
    done = rounds_on_a_slow_link(7 * LINK_S / 8)
    for outcomes in done.outcomes:
        assert all(o.partners for o in outcomes)
        assert all(o.waited_first_s == pytest.approx(LINK_S / 8, abs=0.1) for o in outcomes[1:]), outcomes


def test_the_wait_first_follows_the_link_and_the_steps_not_the_slowest_round_so_far():
    """The first round's steps are quick (its exchange outlasts them by 3/4 of LINK_S),
    the later ones slow (by 1/4). The second round waits first up to the Delta; from the
    third on the wait follows the later rounds' 1/4, instead of staying at the first
    round's (it would cost a quarter of LINK_S a round), and the rounds take the time
    they take with every wait at the boundary, but for that one quarter."""
    steps = [LINK_S / 4] + [3 * LINK_S / 4] * 5
    first = rounds_on_a_slow_link(steps, rounds=5)
    boundary = rounds_on_a_slow_link(steps, rounds=5, wait_first=False)
    for outcomes in first.outcomes:
        assert all(o.partners for o in outcomes)
        assert LINK_S / 2 - 0.1 < outcomes[1].waited_first_s < LINK_S / 2 + 0.2, outcomes
        assert all(o.waited_first_s == pytest.approx(LINK_S / 4, abs=0.1) for o in outcomes[2:]), outcomes
    assert first.wall_s < boundary.wall_s + LINK_S / 4 + 0.2


def test_a_later_stage_whose_steps_its_upstream_drives_does_not_wait_first():
    """Past stage 0 the gate holds no compute (the upstream's micro-batches drive it):
    holding it would only misreport a wait."""
    done = rounds_on_a_slow_link(LINK_S / 4, gate_holds_steps=False)
    assert all(o.partners and o.waited_first_s == 0 for outcomes in done.outcomes for o in outcomes)


def test_an_exchange_done_before_the_next_boundary_lets_the_next_rounds_steps_go_on_at_once():
    done = one_round("fp16")
    assert all(o.waited_first_s == 0 for o in done.outcomes)


def test_both_parts_of_a_pair_payload_may_hold_a_stream_at_once_on_either_protocol():
    """A paced call holds its server slot until its last acknowledgement is read, which
    the caller sends just before its next part: with one slot a peer, the second part was
    at times answered "busy" on a loaded machine, and only one side of the pair paired."""
    served = {}

    class Capture:
        async def serve(self, protocol, handler, limits, authorize=None):
            served[protocol] = limits

    stage = StageParts(SPEC, trained(0, SPEC))

    async def serve():
        await stage.exchange().serve(Capture(), lambda remote: True)

    vclock.run(serve())
    assert served[protocols.OUTER].max_per_peer >= 2 and served[protocols.OUTER_FETCH].max_per_peer >= 2
