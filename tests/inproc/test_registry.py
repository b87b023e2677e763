"""The node's view of the registry: other runs' peers and garbage records are ignored,
and each is logged once."""

import asyncio
import dataclasses
import logging

from swarm_node import __version__
from swarm_node.node import Node
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord


class FakeDHT:
    peer_id = "self-peer"

    def __init__(self, records: dict[str, dict[str, object]]):
        self.records = records

    async def get_subkeys(self, key: str) -> dict[str, object]:
        return self.records.get(key, {})


def test_peers_of_another_run_spec_and_bad_records_are_ignored_and_logged_once(caplog):
    spec = RunSpec(run_id="r")
    other = dataclasses.replace(spec, seq_len=spec.seq_len + 1)
    good = PeerRecord(stage=1, spec_hash=spec.spec_hash(), version=__version__).to_wire()
    foreign = PeerRecord(stage=1, spec_hash=other.spec_hash(), version=__version__).to_wire()
    node = Node(spec, NodeConfig())
    node.dht = FakeDHT({"r/stage/1": {"good": good, "foreign": foreign, "garbage": {"stage": "x"},
                                      "self-peer": good}})
    with caplog.at_level(logging.WARNING, logger="swarm_node.node"):
        for _ in range(3):
            asyncio.run(node._refresh_registry(all_stages=True))
    assert set(node.peers[1]) == {"good"}
    assert node.peers[0] == {}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("foreign"[-6:] in w and "run-spec hash" in w for w in warnings) == 1
    assert sum("unreadable registry record" in w for w in warnings) == 1
