"""Nodes started together wait for each other before their first step
(NodeConfig.wait_for_peers_per_stage, node.py's _wait_for_peers), on a virtual clock."""

import asyncio
import logging
import types

import vclock

from swarm_node.node import Node
from swarm_node.node_config import NodeConfig


class Registry:
    """Stage -> the peers whose training records a refresh finds; more appear at given times."""

    def __init__(self, arrivals: dict[float, tuple[int, str]]):
        self.arrivals, self.peers, self.heartbeats = dict(arrivals), {0: {"Qself": 1}, 1: {}}, 0

    async def refresh(self, all_stages: bool = False) -> None:
        now = asyncio.get_running_loop().time()
        for at, (stage, peer) in list(self.arrivals.items()):
            if at <= now:
                self.peers[stage][peer] = 1
                del self.arrivals[at]

    def live_peers(self, stage: int) -> dict:
        return self.peers[stage]

    async def heartbeat(self) -> None:
        self.heartbeats += 1


def waited(arrivals: dict[float, tuple[int, str]], want: int = 2, timeout_s: float = 60.0) -> tuple[float, Registry]:
    registry = Registry(arrivals)
    node = types.SimpleNamespace(config=NodeConfig(wait_for_peers_per_stage=want, startup_timeout_s=timeout_s),
                                 membership=registry, spec=types.SimpleNamespace(num_stages=2), stage=0,
                                 peer_id="Qself")

    async def scenario():
        await Node._wait_for_peers(node)
        return asyncio.get_running_loop().time()

    return vclock.run(scenario()), registry


def test_a_node_waits_until_every_stage_has_its_peers_and_keeps_its_record_fresh():
    took, registry = waited({3.0: (0, "Qpartner"), 7.5: (1, "Qa"), 9.0: (1, "Qb")})
    assert 9.0 <= took < 10.5
    assert registry.heartbeats >= 3  # every heartbeat_s while it waits: its record does not expire


def test_a_node_that_waits_for_nobody_starts_at_once():
    took, registry = waited({}, want=0)
    assert took == 0 and registry.heartbeats == 0


def test_peers_that_never_come_cost_the_startup_timeout_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="swarm_node.node"):
        took, _ = waited({2.0: (0, "Qpartner")}, timeout_s=20.0)
    assert 20.0 <= took < 21.5
    assert "starting without all peers: stage(s) 1 have fewer than 2" in caplog.text
