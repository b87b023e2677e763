"""Two stages' data paths joined back to back, the run sending activations and their
gradients in int8 (the run spec's activation_codec): the micro-batch trains, the
gradient that comes back is the one the next stage computed, to int8 precision, and
the hop moves about half the bytes of fp16."""

import asyncio
import dataclasses

import pytest
import torch
from parts import StageParts, body_out, record

from swarm_node.data.spec import DataSpec
from swarm_node.net import protocols
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import outgoing
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="acts", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))
VOCAB = 16


def one_hop(codec: str, scale: float = 1.0) -> tuple[torch.Tensor, float, int, torch.Tensor]:
    """(gradient stage 0 received, loss, bytes both ways, the gradient stage 1 computed in
    fp32), for stage 0's output times ``scale``."""
    spec = dataclasses.replace(SPEC, activation_codec=codec)
    first, second = StageParts(spec, StageWorker(spec, 0, VOCAB)), StageParts(spec, StageWorker(spec, 1,
                                                                                                VOCAB))
    downstream, sent = second.pipeline(), []

    class Link:
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
            assert protocol == protocols.FORWARD
            body_out(pacing)
            answer = await downstream.handle_forward("QmFirst", payload)
            sent.append(len(payload) + len(answer))
            return answer

    first.transport = Link()
    first.membership.peers = {1: {"QmSecond": record(1, spec)}}
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16),
                                                                                   generator=g)
    hidden = first.worker.forward(tokens) * scale
    grad, loss = asyncio.run(first.pipeline().next_hop.send(*outgoing(hidden, spec.activation_codec), targets,
                                                             timeout_s=30.0))
    exact = hidden.clone().requires_grad_(True)
    # the same weights: built from the run's seed
    StageWorker(spec, 1, VOCAB).stage(exact, targets).backward()
    return grad, loss, sum(sent), exact.grad


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_hop_in_the_runs_activation_codec_returns_the_next_stages_gradient(codec):
    grad, loss, _, exact = one_hop(codec)
    assert 0 < loss < 10
    relative = ((grad - exact).norm() / exact.norm()).item()
    assert relative < 0.02, relative


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_hop_past_plain_fp16s_range_trains_and_its_tiny_gradient_comes_back(codec):
    """A stage-0 output that grew to ~3e5 (the next stage's RMSNorm does not mind; a real
    run's went past 65504): plain fp16 made it infinite, and the gradient, which shrinks
    as the activation grows (1e-9 to 6e-7 here), sank into fp16's subnormals."""
    grad, loss, _, exact = one_hop(codec, scale=1e5)
    plain_fp16 = exact.half().float()
    assert ((plain_fp16 - exact).norm() / exact.norm()).item() > 0.1 and 0 < loss < 10
    relative = ((grad - exact).norm() / exact.norm()).item()
    assert relative < 0.02, relative


def test_int8_halves_the_bytes_of_a_hop():
    assert one_hop("int8")[2] <= 0.55 * one_hop("fp16")[2]



def test_activations_far_out_of_the_recent_scale_are_refused_without_blaming_the_sender():
    """Early in a run stage 0's activations grow fast (100-200x within seconds in a real
    2 x 2 run); a micro-batch far above the median of the moment is refused, so the
    sender routes it elsewhere, but not counted as a fault (eight ban a caller, which
    cut stage 0 off for good), and a scale that lasts is accepted soon."""
    from swarm_node.train.hop_work import forward_request
    from swarm_node.wire.frames import decode_frame

    second = StageParts(SPEC, StageWorker(SPEC, 1, VOCAB))
    downstream = second.pipeline()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 16, StageWorker(SPEC, 0, VOCAB).model_config.hidden_size, generator=g)
    targets = torch.randint(0, VOCAB, (4, 16), generator=g)

    def hop(scale: float) -> dict:
        payload = forward_request({"kind": "fwd", "spec": SPEC.spec_hash(), "deadline_s": 30.0},
                                  hidden * scale,
                                  targets, SPEC.activation_codec)
        return decode_frame(asyncio.run(downstream.handle_forward("QmFirst", payload)),
                            downstream.frame_limits)[0]

    assert all(hop(1.0)["ok"] for _ in range(8))
    jumped = [hop(300.0) for _ in range(12)]
    assert not jumped[0]["ok"] and jumped[0]["error"].startswith("out of scale: activation RMS")
    assert jumped[-1]["ok"]  # the new scale filled half the window
    assert second.guard.faults("QmFirst") == 0 and second.guard.admit("QmFirst")


@pytest.mark.parametrize("scale,what", [(float("inf"), "infinite"), (float("nan"), "NaN")])
def test_our_own_activations_that_are_not_finite_on_the_wire_are_not_sent(scale, what):
    """Infinite or NaN: the next stage would count such a micro-batch against us and
    stop taking ours (in a real run, stage 1 refused every stage-0 peer for 30 minutes),
    so it is not sent; the caller loses the micro-batch."""
    from swarm_node.errors import OwnOutputNotFinite

    first = StageParts(SPEC, StageWorker(SPEC, 0, VOCAB))
    calls = []

    class Link:
        async def request(self, peer, protocol, payload, **_):
            calls.append(peer)
            raise AssertionError("nothing may be sent")

    first.transport = Link()
    first.membership.peers = {1: {"QmSecond": record(1, SPEC)}}
    hidden = torch.ones(4, 16, first.worker.model_config.hidden_size)
    hidden[0, 0, 0] = scale
    targets = torch.zeros(4, 16, dtype=torch.long)
    counts = "1 NaN and 0 infinite" if what == "NaN" else "0 NaN and 1 infinite"
    with pytest.raises(OwnOutputNotFinite, match=counts):
        asyncio.run(first.pipeline().next_hop.send(*outgoing(hidden, SPEC.activation_codec), targets, 30.0))
    assert calls == []


def test_a_micro_batch_lost_to_our_own_activations_is_counted_each_time_and_said_once(caplog):
    from swarm_node.errors import OwnOutputNotFinite

    pipeline = StageParts(SPEC, StageWorker(SPEC, 0, VOCAB)).pipeline()
    with caplog.at_level("ERROR", logger="swarm_node.train.pipeline"):
        for _ in range(3):
            pipeline._own_output_not_finite(OwnOutputNotFinite("1 NaN and 0 infinite values"))
    assert pipeline.stats.microbatches_lost == 3
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "weights may have diverged" in caplog.text
