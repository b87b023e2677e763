"""A next-stage peer that answered slowly for a while (a warm-up, a busy moment) gets its
share of micro-batches back once it is as fast as the others, and a peer that stays slow
keeps getting less. Routing weighs what our own hops measured, and a peer is measured
only when it is chosen: a figure that moved a tenth of the way per answer kept a peer
that was slow at the start out of most of a short run (CI: a stage-1 peer of a 2x2 local
swarm got 45 micro-batches, its partner 135, and had one round where the test wants two).

Stage 0 here is the real NextHop.send (train/next_hop.py) on a virtual clock, with its compute
modelled as the time it takes (it sets the pace, as in a local swarm of the debug model:
a next-stage peer is idle between micro-batches, so its round trips do not grow with the
share it gets, and nothing but the measured figure moves that share)."""

import asyncio
import random

import pytest
import torch
import vclock
from parts import StageParts, body_out, record

from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import outgoing
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame

SPEC = RunSpec(run_id="share", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4)
HIDDEN = torch.zeros(4, 16, 64)
TARGETS = torch.zeros(4, 16, dtype=torch.long)
ANSWER = encode_frame({"ok": True, "loss": 2.0}, encode_activations(torch.zeros_like(HIDDEN), "fp16"))
SLOW_START, STEADY = "QmSlowStart", "QmSteady"
STAGE0_S = 0.1  # stage 0's own work for a micro-batch (forward, backward) on its one compute thread
SERVICE_S = 0.02  # a next-stage peer's time for a micro-batch
SLOW_S = 2.0  # QmSlowStart's time for a micro-batch while it is slow (a hundred times the usual)
SLOW_FOR_S = 4.0  # how long it is slow from the start (a warm-up, a busy machine)
MICROBATCHES = 350


class NextStage:
    """Two next-stage peers, each serving one micro-batch at a time in arrival order.
    QmSlowStart takes ``slow_s`` for a micro-batch it starts in its first ``slow_for_s``
    seconds; then it is as fast as QmSteady."""

    def __init__(self, slow_for_s: float, slow_s: float = SLOW_S):
        self.slow_for_s, self.slow_s = slow_for_s, slow_s
        self.busy = {SLOW_START: asyncio.Lock(), STEADY: asyncio.Lock()}
        self.answered: list[str] = []  # who answered each micro-batch, in order
        self.answered_when_slow = 0  # len(answered) when its last slow micro-batch was done

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        body_out(pacing)  # at once: the peers' compute sets the pace, not a link
        async with self.busy[peer]:
            slow = peer == SLOW_START and asyncio.get_running_loop().time() < self.slow_for_s
            await asyncio.sleep(self.slow_s if slow else SERVICE_S)
        self.answered.append(peer)
        if slow:
            self.answered_when_slow = len(self.answered)
        return ANSWER


async def run_stage_0(peers: NextStage, seed: int) -> None:
    stage = StageParts(SPEC, StageWorker(SPEC, 0, 16), transport=peers)
    stage.membership.peers = {1: {p: record(1, SPEC) for p in (SLOW_START, STEADY)}}
    for peer in (SLOW_START, STEADY):
        stage.guard.reached(peer)  # verified: both served us before
    pipeline = stage.pipeline()
    pipeline.next_hop.chooser.rng = random.Random(seed)
    compute = asyncio.Lock()
    left = [MICROBATCHES]

    async def lane() -> None:  # one of the micro-batches stage 0 keeps in flight
        while left[0] > 0:
            left[0] -= 1
            async with compute:
                await asyncio.sleep(STAGE0_S)
            await pipeline.next_hop.send(*outgoing(HIDDEN, SPEC.activation_codec), TARGETS, timeout_s=30.0)

    await asyncio.gather(*(lane() for _ in range(stage.config.max_in_flight)))


def share_of_slow_start(peers: NextStage, start: int, count: int) -> float:
    window = peers.answered[start:start + count]
    assert len(window) == count
    return window.count(SLOW_START) / count


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_peer_slow_at_first_gets_its_share_back_once_it_is_fast(seed):
    peers = NextStage(slow_for_s=SLOW_FOR_S)
    vclock.run(run_stage_0(peers, seed))
    recovered_at = peers.answered_when_slow
    assert 0 < recovered_at <= 60  # it was tried while slow; about 10 micro-batches a second went on
    # From 30 micro-batches after its last slow answer it has about half of the next 200.
    # When a figure moved a tenth of the way per answer it had 12-33 % of them with these
    # seeds (8 seeds in 10 under 35 %; the other two got queued micro-batches answered
    # fast soon after the slow start).
    assert 0.4 <= share_of_slow_start(peers, recovered_at + 30, 200) <= 0.6, peers.answered


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_peer_that_stays_slow_keeps_getting_less(seed):
    """The fading that lets a recovered peer back in must not hand a slow one half the
    micro-batches: at five times the others' round trip it gets well under a third."""
    peers = NextStage(slow_for_s=float("inf"), slow_s=5 * SERVICE_S)
    vclock.run(run_stage_0(peers, seed))
    assert share_of_slow_start(peers, 50, 300) <= 0.3, peers.answered
