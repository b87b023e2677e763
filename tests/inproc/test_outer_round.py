"""A node's outer round as its peers see it: the registry record says `seeking` while
the round is open, and a round that finds no partner ends in the local-only step."""

import vclock
from swarm_node.data.spec import DataSpec
from swarm_node.net import protocols
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.codec import encode_frame

from parts import StageParts, record

SPEC = RunSpec(run_id="rounds", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2),
               inner=InnerHyper(lr=1e-3, warmup_steps=1, total_steps=100))


def test_the_record_says_seeking_while_the_round_is_open():
    stage = StageParts(SPEC, StageWorker(SPEC, 1, 16), config=NodeConfig(round_timeout_s=0.5))
    stage.membership.peers = {1: {"QmOther": record(1, SPEC)}}
    proposals = []

    class Refusing:  # every peer answers our proposals "busy"
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes):
            assert protocol == protocols.PAIR
            proposals.append(peer)
            return encode_frame({"ok": False, "error": "busy"})

    stage.transport = Refusing()
    exchange = stage.exchange()

    async def round_then_heartbeat():  # as the node runs it: the record is published after the round
        await exchange.run_round()
        await exchange.announce()

    vclock.run(round_then_heartbeat())  # the 0.5 s round deadline passes in virtual time
    assert stage.announced[0] is True, stage.announced  # announced as the round opened, not at the next heartbeat
    assert stage.announced[-1] is False  # and withdrawn after it
    assert proposals and set(proposals) == {"QmOther"}
    assert stage.stats.local_only_rounds == 1 and stage.worker.outer_round == 1
