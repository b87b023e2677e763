"""Stage 0 on a link that sets the pace: nothing lost, the link kept busy, and the
figures /api/status shows (bytes per token across the boundary, the share of time
stage 0 waited on its link) as the link saw them.

The next stage here is a fake on a virtual clock: stage 0's uplink carries one request
at a time at ``TX_S`` a micro-batch, each next-stage peer's uplink its answers at the
same pace; stage 0's compute takes no virtual time. A micro-batch crosses in 12 s each
way, so a second one out with it queues 12 s behind it on the uplink: the fixed 30 s
hop deadline lost it (and every later one queued so), where a deadline that stretches
with the measured link (routing/window.py) loses none."""

import asyncio

import pytest
import torch
import vclock
from parts import StageParts, body_out, record

from swarm_node.data.dataset import load_windows
from swarm_node.data.source import RunData
from swarm_node.data.spec import DataSpec
from swarm_node.errors import PeerTimeout
from swarm_node.node_config import NodeConfig
from swarm_node.optim import default_method
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import forward_request
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import decode_frame, encode_frame

SPEC = RunSpec(run_id="slowlink", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4, data=DataSpec(kind="synthetic"),
               method=default_method("noloco", inner_steps=50))
MIDDLE_SPEC = RunSpec(run_id="slowlink", model_size="debug", num_stages=3, layers_per_stage=(0, 1, 1),
                      seq_len=16, batch_size=4, samples_per_step=4, data=DataSpec(kind="synthetic"),
                      method=default_method("noloco", inner_steps=50))
TX_S = 12.0  # one micro-batch's request (or answer) on its uplink
MICROBATCHES = 20
PEERS = ("QmNextA", "QmNextB")


class LinkBoundNextStage:
    """Two next-stage peers behind slow links: stage 0's uplink moves one request at a
    time, each peer's uplink one answer at a time, each ``TX_S``; the caller's deadline
    cuts a request as a real transport's does."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.uplink = asyncio.Lock()
        self.answer_links = {p: asyncio.Lock() for p in PEERS}
        self.most_out = 0
        self._out = 0

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self._out += 1
        self.most_out = max(self.most_out, self._out)
        try:
            async with asyncio.timeout(timeout_s):
                async with self.uplink:
                    await asyncio.sleep(TX_S)
                body_out(pacing, TX_S)
                async with self.answer_links[peer]:
                    await asyncio.sleep(TX_S)
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {peer} timed out after {timeout_s:.1f}s") from None
        finally:
            self._out -= 1
        return self.answer


def link_bound_stage_0(spec, max_steps: int):
    """Stage 0 whose next stage is PEERS behind a link that moves one micro-batch each TX_S:
    (its parts, the next stage, its pipeline with the data open, the answer's bytes)."""
    data = load_windows(spec.data, spec.seq_len)
    worker = StageWorker(spec, 0, data.vocab_size)
    answer = encode_frame({"ok": True, "loss": 2.0},
                          encode_activations(torch.zeros(4, 16, worker.model_config.hidden_size), "fp16"))
    next_stage = LinkBoundNextStage(answer)
    stage = StageParts(spec, worker, config=NodeConfig(max_steps=max_steps), transport=next_stage)
    stage.membership.peers = {1: {p: record(1, spec) for p in PEERS}}
    for peer in PEERS:
        stage.guard.reached(peer)
    pipeline = stage.pipeline()
    pipeline.open_data(RunData.in_memory(spec, data), "QmSelf", resumed=None)
    return stage, next_stage, pipeline, answer


@pytest.mark.timeout(120)
def test_a_link_bound_stage_0_loses_nothing_and_keeps_its_link_busy():
    stage, next_stage, pipeline, answer = link_bound_stage_0(SPEC, MICROBATCHES)

    async def scenario() -> float:
        clock = asyncio.get_running_loop().time
        started = clock()
        # as long as the link needs, and then some: a stage that loses micro-batches draws more
        await asyncio.wait_for(pipeline.produce(finished=lambda: asyncio.sleep(0)), 3 * MICROBATCHES * TX_S)
        return clock() - started

    elapsed_s = vclock.run(scenario())
    stats = stage.stats
    assert stats.microbatches_lost == 0 and stats.microbatches_done == MICROBATCHES
    link_allows = SPEC.batch_size * SPEC.seq_len / TX_S  # tokens/s: one micro-batch each TX_S up
    assert stats.tokens / elapsed_s >= 0.8 * link_allows, (stats.tokens / elapsed_s, link_allows)
    # no more out than the link holds (2: one each way) and one more, give or take a burst; 8 is the cap
    assert next_stage.most_out <= 4
    # the figures /api/status shows: every request and answer byte, per token; stage 0 waited on its link
    tokens = MICROBATCHES * SPEC.batch_size * SPEC.seq_len
    assert stats.to_next.tokens == tokens and stats.to_next.received == MICROBATCHES * len(answer)
    assert stats.to_next.sent > MICROBATCHES * 4 * 16 * stage.worker.model_config.hidden_size * 2
    assert stats.boundaries(0) == {"0-1": {"sent": round(stats.to_next.sent / tokens, 2),
                                           "received": round(len(answer) / 64, 2), "tokens": tokens}}
    # blocked on a full window all along, but for the drain at the end (the window's last few)
    assert 0.7 <= stats.link_wait_s / elapsed_s <= 1.0


class RecordingNextStage:
    def __init__(self):
        self.timeouts: list[float] = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
        self.timeouts.append(timeout_s)
        raise PeerTimeout("gone")


@pytest.mark.parametrize("asked_s, expected_s", [(100.0, 90.0), (1000.0, 270.0)])
def test_a_middle_stage_gives_its_hop_the_deadline_its_caller_asked_within_the_cap(asked_s, expected_s):
    """The caller's deadline covers its link's queue, so the stage it serves honours it
    (its own hop gets nine tenths), capped at max_hop_deadline_s: an untrusted caller
    cannot ask for unbounded time."""
    worker = StageWorker(MIDDLE_SPEC, 1, 16)
    next_stage = RecordingNextStage()
    middle = StageParts(MIDDLE_SPEC, worker, config=NodeConfig(hop_retries=0), transport=next_stage)
    middle.membership.peers = {2: {"QmLast": record(2, MIDDLE_SPEC)}}
    middle.guard.reached("QmLast")
    server = middle.pipeline()
    g = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, 16, (4, 16), generator=g) for _ in range(2))
    activations = StageWorker(MIDDLE_SPEC, 0, 16).forward(inputs)
    request = forward_request({"kind": "fwd", "spec": MIDDLE_SPEC.spec_hash(), "deadline_s": asked_s},
                              activations, targets, MIDDLE_SPEC.activation_codec)
    answer, _ = decode_frame(vclock.run(server.handle_forward("QmFirst", request)))
    assert answer["ok"] is False  # the next stage is gone: what matters is the time it was given
    assert next_stage.timeouts == [pytest.approx(expected_s)]
