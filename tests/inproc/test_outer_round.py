"""A node's outer round as its peers see it: the registry record says `seeking` while
the round is open, and a round that finds no partner ends in the local-only step."""

import asyncio

from swarm_node.data.spec import DataSpec
from swarm_node.gossip.pairing import Refused
from swarm_node.node import Node
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.records import PeerRecord

SPEC = RunSpec(run_id="rounds", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


def test_the_record_says_seeking_while_the_round_is_open():
    node = Node(SPEC, NodeConfig(round_timeout_s=0.5))
    node._adopt_spec(SPEC)
    node.stage = 1
    node.worker = StageWorker(SPEC, 1, 16)
    node.dht = type("D", (), {"peer_id": "QmSelf"})()
    node.peers = {1: {"QmOther": PeerRecord(stage=1, spec_hash=node.spec_hash, version="0", state="training")}}
    published, proposals = [], []

    async def heartbeat():
        published.append(node._record().seeking)

    async def refuse(peer, timeout_s):
        proposals.append(peer)
        raise Refused("busy")

    node._heartbeat, node._send_proposal = heartbeat, refuse
    try:
        asyncio.run(node._outer_round())
    finally:
        node._compute.shutdown()
    assert published[0] is True, published  # announced as the round opened, not at the next heartbeat
    assert published[-1] is False  # and withdrawn after it
    assert proposals and set(proposals) == {"QmOther"}
    assert node.stats.local_only_rounds == 1 and node.worker.outer_round == 1
