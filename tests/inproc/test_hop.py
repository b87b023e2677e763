"""The hop (forward, send to a next-stage peer, backward) is one method of Pipeline for
stage 0's own micro-batches and for those a middle stage serves: a micro-batch lost on
the way is handled the same at either, counted, said once in the node's last error and
logged; the middle stage then tells the stage before why."""

import logging

import torch
import vclock
from parts import StageParts

from swarm_node.data.spec import DataSpec
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.hop_work import forward_request
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame

SPEC = RunSpec(run_id="hop", model_size="debug", num_stages=3, layers_per_stage=(0, 1, 1), seq_len=16,
               batch_size=4, samples_per_step=4, data=DataSpec(kind="synthetic"),
               method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))
VOCAB = 16


def stage(index: int) -> StageParts:
    """A stage whose next stage has nobody in it: every hop runs out of its deadline."""
    return StageParts(SPEC, StageWorker(SPEC, index, VOCAB), config=NodeConfig(hop_timeout_s=2.0))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g)


def test_a_micro_batch_lost_downstream_is_handled_alike_by_stage_0_and_a_middle_stage(caplog):
    inputs, targets = tokens()
    first = stage(0)
    producer = first.pipeline()
    producer.in_flight = 1  # as produce() counts it before the hop
    middle = stage(1)
    server = middle.pipeline()
    request = forward_request({"kind": "fwd", "spec": SPEC.spec_hash(), "deadline_s": 2.0},
                              StageWorker(SPEC, 0, VOCAB).forward(inputs), targets, SPEC.activation_codec)
    with caplog.at_level(logging.INFO, logger="swarm_node.train.pipeline"):
        vclock.run(producer._run_microbatch(inputs, targets))
        answer, _ = decode_frame(vclock.run(server.handle_forward("QmFirst", request)))
    for parts, next_stage in ((first, 1), (middle, 2)):
        assert parts.stats.microbatches_lost == 1 and parts.stats.microbatches_done == 0
        assert parts.stats.last_error.startswith(f"micro-batch lost: no stage-{next_stage} peer completed")
    assert producer.in_flight == 0 and server.queue == 0
    assert answer["ok"] is False and answer["error"].startswith("downstream: no stage-2 peer completed")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["micro-batch lost"] * 2
