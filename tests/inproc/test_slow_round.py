"""The outer round on a full slow link: the payload gets the link while it moves (stage 0
holds its micro-batches in flight to one meanwhile), and the exchange's deadline
stretches with the uplink this node measured carrying the pipeline, capped; never with
what a partner says of itself.

On a virtual clock: a payload that takes 40 s on the link each way (a 1.6 MB payload
sharing a 1 Mbit/s uplink) outlasts the fixed 30 s deadline, and the round went
local-only; with the measured link it pairs."""

import asyncio
import dataclasses

import pytest
import torch
import vclock
from parts import StageParts, record
from test_overlapped_exchange import SPEC, Link, trained
from test_slow_link import SPEC as PIPELINE_SPEC
from test_slow_link import TX_S as MICROBATCH_TX_S
from test_slow_link import link_bound_stage_0

from swarm_node.errors import PeerTimeout
from swarm_node.gossip.exchange import ExchangeTimes, OuterExchange
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.routing.window import MIN_WINDOW
from swarm_node.train.hop_work import forward_request
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame

PAYLOAD_S = 40.0  # each payload on the link, both parts, while the pipeline shares it
FLOOR_S = 30.0


def a_round_on_a_full_link(measured: list[float | None]) -> tuple[list, list[bool]]:
    """Two nodes' round; ``measured``: what each one's pipeline says its uplink carries
    (bytes/s). Returns their outcomes and, for each payload part sent, whether the
    sender's gate said a payload was on the link."""
    spec = dataclasses.replace(SPEC, outer_codec="fp16")
    ids = ["QmAaa", "QmBbb"]
    config = NodeConfig(round_timeout_s=20.0, exchange_timeout_s=FLOOR_S)
    stages = [StageParts(spec, trained(i, spec), config=config) for i in range(2)]
    worker = stages[0].worker
    payload_bytes = int(sum(p.numel() for p in worker.params) * worker.codec.bytes_per_parameter())
    link = Link(payload_bytes / PAYLOAD_S)
    on_link: list[bool] = []

    async def both():
        exchanges = []
        for own, other, stage, rate in zip(ids, reversed(ids), stages, measured):
            transport = link.transport(own)

            class Watched:
                async def request(self, peer, protocol, payload, *, gate=stage.gate, inner=transport, **kw):
                    if protocol == protocols.OUTER:
                        on_link.append(gate.payload_on_link())
                    try:
                        return await inner.request(peer, protocol, payload, **kw)
                    except TimeoutError:  # as a real transport says it
                        raise PeerTimeout(f"{protocol} to {peer} timed out") from None

            stage.transport = Watched()
            stage.membership.peers = {1: {other: record(1, spec)}}
            stage.guard.reached(other)
            times = ExchangeTimes(config.round_timeout_s, config.exchange_timeout_for(payload_bytes),
                                  payload_bytes=payload_bytes, max_exchange_s=config.max_exchange_s)
            exchange = link.exchanges[own] = OuterExchange(
                spec_hash=spec.spec_hash(), method=spec.method.name, times=times, state=stage.worker,
                gate=stage.gate, candidates=stage.membership.partner_candidates,
                callers_expected=stage.membership.callers_expected, announce=lambda: asyncio.sleep(0),
                stopping=stage.stopping, own_id=own, link_bytes_s=lambda rate=rate: rate, **stage.common())
            exchanges.append(exchange)
        for stage in stages:
            stage.gate.note_due(True)
        return await asyncio.gather(*(e.run_round() for e in exchanges))

    return vclock.run(both()), on_link


@pytest.mark.timeout(60)
def test_a_round_whose_payloads_outlast_the_floor_pairs_by_the_link_each_side_measured():
    # each side measured its uplink moving a payload alone in half the time it takes shared
    spec = dataclasses.replace(SPEC, outer_codec="fp16")
    worker = trained(0, spec)
    payload_bytes = sum(p.numel() for p in worker.params) * worker.codec.bytes_per_parameter()
    rate = 2 * payload_bytes / PAYLOAD_S
    outcomes, on_link = a_round_on_a_full_link([rate, rate])
    assert all(o.partners for o in outcomes), outcomes
    assert all(o.exchange_s is not None and o.exchange_s >= PAYLOAD_S for o in outcomes)
    # the sender's gate said so while each part was on its way: stage 0 held its window to one
    assert on_link and all(on_link)


@pytest.mark.timeout(60)
def test_with_nothing_measured_the_floor_holds_and_the_round_goes_local_only():
    outcomes, _ = a_round_on_a_full_link([None, None])
    assert not any(o.partners for o in outcomes)


@pytest.mark.parametrize("measured, expected_s", [
    (None, FLOOR_S), (0.0, FLOOR_S), (-5.0, FLOOR_S),
    (1e9, FLOOR_S),  # a fast link: the floor
    (100_000.0, 3 * 2 * 1_000_000 / 100_000),  # 1 MB, shared with one micro-batch, three times
    (1.0, 300.0),  # a link that hardly moves: capped
])
def test_the_deadline_stretches_with_our_measured_link_within_the_cap(measured, expected_s):
    times = ExchangeTimes(20.0, FLOOR_S, payload_bytes=1_000_000, max_exchange_s=300.0)
    assert times.deadline_s(measured) == pytest.approx(expected_s)
    assert times.most_s == 300.0
    # without a cap (the simulator's peers) it never stretches
    assert ExchangeTimes(20.0, FLOOR_S, payload_bytes=1_000_000).deadline_s(1.0) == FLOOR_S


@pytest.mark.timeout(120)
def test_stage_0_holds_one_micro_batch_in_flight_while_a_payload_moves_and_measures_its_link():
    stage, next_stage, pipeline, _ = link_bound_stage_0(PIPELINE_SPEC, 16)
    moving = [True]
    stage.gate.payload_on_link = lambda: moving[0]
    most_out = []
    held_deadline = []

    async def scenario():
        producing = asyncio.create_task(pipeline.produce(finished=lambda: asyncio.sleep(0)))
        await asyncio.sleep(8 * MICROBATCH_TX_S)
        most_out.append(next_stage.most_out)
        held_deadline.append((pipeline.hop_deadline_s, pipeline.unheld_window,
                              pipeline.window.deadline_s(pipeline.unheld_window, stage.config.hop_timeout_s,
                                                         stage.config.max_hop_deadline_s),
                              pipeline.window.deadline_s(1, stage.config.hop_timeout_s,
                                                         stage.config.max_hop_deadline_s)))
        moving[0] = False
        next_stage.most_out = 0
        await asyncio.wait_for(producing, 60 * MICROBATCH_TX_S)
        most_out.append(next_stage.most_out)

    vclock.run(scenario())
    assert most_out[0] == 1 and most_out[1] > 1, most_out
    # a hop sent while the window is held still counts the window held back: the payload
    # crosses the link in their place (at 2 Mbit/s a hop given one micro-batch's time was lost)
    deadline_s, unheld, expected_s, one_s = held_deadline[0]
    assert unheld > 1 and deadline_s == pytest.approx(expected_s) and deadline_s > one_s, held_deadline
    assert stage.stats.microbatches_lost == 0
    # its uplink: one request a TX_S at best, as the delivery rate saw it
    request_bytes = stage.stats.to_next.sent / stage.stats.microbatches_done
    assert pipeline.uplink_bytes_s() == pytest.approx(request_bytes / MICROBATCH_TX_S, rel=0.15)


def test_a_later_stage_measures_its_uplink_by_the_pace_of_its_answers():
    worker = StageWorker(PIPELINE_SPEC, 1, 16)
    stage = StageParts(PIPELINE_SPEC, worker)
    server = stage.pipeline()
    g = torch.Generator().manual_seed(0)
    first = StageWorker(PIPELINE_SPEC, 0, 16)

    async def serve_three():
        answers = []
        for _ in range(3):
            inputs, targets = (torch.randint(0, 16, (4, 16), generator=g) for _ in range(2))
            request = forward_request({"kind": "fwd", "spec": PIPELINE_SPEC.spec_hash()},
                                      first.forward(inputs).detach(), targets, PIPELINE_SPEC.activation_codec)
            assert server.uplink_bytes_s() is None or answers
            answers.append(await server.handle_forward("QmFirst", request))
            await asyncio.sleep(10.0)
        return answers

    answers = vclock.run(serve_three())
    assert all(decode_frame(a)[0]["ok"] for a in answers)
    assert server.uplink_bytes_s() == pytest.approx(len(answers[0]) / 10.0, rel=0.05)


def test_every_hop_is_given_the_deadline_of_the_window_it_shares_the_link_with():
    """Paced flows share a link alike: micro-batches sent after a hop slow it as the window
    fills, so a hop sent with fewer in flight than the window gets the deadline of the
    window, not of those in flight (on a 2 Mbit/s link one sent with the deadline of one,
    36 s, was lost when the window grew to 3)."""
    _, _, pipeline, _ = link_bound_stage_0(PIPELINE_SPEC, 8)
    pipeline._window(accepts=8)  # sized, as stage 0 does before each micro-batch
    pipeline.in_flight = 1
    assert pipeline.unheld_window >= MIN_WINDOW
    assert pipeline._hop_flights() == pipeline.unheld_window
