"""A partner whose outer update is scaled up or not finite is rejected and banned; the
node keeps accepting well-formed updates from others."""

import asyncio

import torch

from swarm_node.data.spec import DataSpec
from swarm_node.node import Node
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.codec import FrameLimits, decode_frame, encode_frame

SPEC = RunSpec(run_id="poison", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))


def trained_worker(seed: int) -> StageWorker:
    worker = StageWorker(SPEC, 1, 16)
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):
        worker.forward_backward_last(torch.randn(4, 16, worker.model_config.hidden_size, generator=g),
                                     torch.randint(0, 16, (4, 16), generator=g))
        worker.step()
    return worker


def request(phi, delta) -> bytes:
    return encode_frame({"kind": "outer", "spec": SPEC.spec_hash(), "round": 0, "ok": True}, [*phi, *delta])


def test_scaled_up_or_nan_updates_are_rejected_and_the_sender_banned():
    node = Node(SPEC, NodeConfig())
    node._adopt_spec(SPEC)
    node.worker = trained_worker(0)
    node.stage = 1
    node.dht = type("D", (), {"peer_id": "QmSelf"})()
    node.outer_limits = FrameLimits(max_payload_bytes=64 << 20)
    phi, delta = trained_worker(1).outer_payload("fp32")

    async def scenario():
        answers = {}
        answers["honest"] = await node._handle_outer("QmHonest", request(phi, delta))
        answers["x1000"] = await node._handle_outer("QmScaled", request(phi, [d * 1000 for d in delta]))
        answers["nan"] = await node._handle_outer("QmNan", request(phi, [torch.full_like(d, float("nan"))
                                                                          for d in delta]))
        answers["honest again"] = await node._handle_outer("QmHonest", request(phi, delta))
        return answers

    try:
        answers = {k: decode_frame(v)[0] for k, v in asyncio.run(scenario()).items()}
    finally:
        node._compute.shutdown()
    assert answers["x1000"]["error"] == "protocol" == answers["nan"]["error"]
    assert node.chooser.is_banned("QmScaled") and node.chooser.is_banned("QmNan")
    assert answers["honest"].get("error") != "protocol" and answers["honest again"].get("error") != "protocol"
    assert not node.chooser.is_banned("QmHonest")
