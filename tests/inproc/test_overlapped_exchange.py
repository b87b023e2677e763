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
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="overlap", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))
LINK_S = 3.0  # each payload spends this long on the wire (virtual time)


class Link:
    """Requests go straight to the other node's handlers; a payload takes LINK_S."""

    def __init__(self):
        self.exchanges, self.bytes = {}, collections.Counter()

    def transport(self, own_id: str):
        link = self

        class Transport:
            async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes):
                link.bytes[protocol] += len(payload)
                async with asyncio.timeout(timeout_s):
                    if protocol == protocols.OUTER:
                        await asyncio.sleep(LINK_S)
                    other = link.exchanges[peer]
                    handler = other.handle_propose if protocol == protocols.PAIR else other.handle_outer
                    answer = await handler(own_id, payload)
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


def one_round(codec: str, blocking: bool = False) -> tuple[list[StageParts], collections.Counter, list[bool]]:
    spec = dataclasses.replace(SPEC, outer_codec=codec)
    link = Link()
    ids = ["QmAaa", "QmBbb"]
    stages = [StageParts(spec, trained(i, spec), config=NodeConfig(round_timeout_s=30.0))
              for i in range(2)]
    steps_open = []  # whether the gate let steps through while the payload was on the wire

    async def both():
        exchanges = []
        for own, other, stage in zip(ids, reversed(ids), stages):
            stage.transport = link.transport(own)
            stage.membership.peers = {1: {other: record(1, spec)}}
            stage.guard.reached(other)  # a peer we talked to before: verified
            exchange = stage.exchange(own_id=own, overlapped=not blocking)
            link.exchanges[own] = exchange
            exchanges.append(exchange)
        for stage in stages:
            stage.gate.note_due(True)
        rounds = [asyncio.create_task(e.run_round()) for e in exchanges]
        await asyncio.sleep(LINK_S / 2)
        steps_open.extend(stage.gate.idle.is_set() for stage in stages)
        await asyncio.gather(*rounds)

    vclock.run(both())
    return stages, link.bytes, steps_open


@pytest.mark.parametrize("codec", ["fp16", "int8", "near4-3"])
def test_a_round_pairs_and_moves_the_bytes_its_codec_says(codec):
    stages, sent, _ = one_round(codec)
    assert all(s.stats.rounds_with_partner == 1 and s.worker.outer_round == 1 for s in stages)
    numel = sum(p.numel() for p in stages[0].worker.params)
    per_parameter = sent[protocols.OUTER] / (2 * numel)  # each of the two sent its payload once
    assert per_parameter == pytest.approx(stages[0].worker.codec.bytes_per_parameter(), rel=0.02)


def test_the_default_round_sends_at_most_a_quarter_of_a_16_bit_one():
    default = one_round(SPEC.outer_codec)[1][protocols.OUTER]
    assert default <= 0.25 * one_round("fp16")[1][protocols.OUTER]


def test_an_overlapped_round_lets_the_steps_go_on_and_a_blocking_one_holds_them():
    _, _, overlapped = one_round("fp16")
    _, _, blocking = one_round("fp16", blocking=True)
    assert overlapped == [True, True] and blocking == [False, False]
