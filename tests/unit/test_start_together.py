"""Nodes started together wait for each other before stage 0's first micro-batch
(NodeConfig.wait_for_peers_per_stage, node.py's _wait_for_peers), on a virtual clock."""

import asyncio
import logging
import types

import vclock

from swarm_node.node.conductor import Node
from swarm_node.node_config import NodeConfig


class View:
    """Stage -> the peers the registry loop has read as training so far: more appear at
    given times, as its reads bring them."""

    def __init__(self, arrivals: dict[float, tuple[int, str]]):
        self.arrivals = arrivals

    def live_peers(self, stage: int) -> dict:
        now = asyncio.get_running_loop().time()
        return {peer: 1 for at, (s, peer) in self.arrivals.items() if s == stage and at <= now}


def waited(arrivals: dict[float, tuple[int, str]], want: int = 2, timeout_s: float = 60.0,
           num_stages: int = 3) -> tuple[float, types.SimpleNamespace]:
    node = types.SimpleNamespace(config=NodeConfig(wait_for_peers_per_stage=want,
                                                   startup_timeout_s=timeout_s), membership=View(arrivals),
                                 spec=types.SimpleNamespace(num_stages=num_stages), stage=0, peer_id="Qself",
                                 _training_since=None, _training_started_unix=None)

    async def scenario():
        await Node._wait_for_peers(node)
        return asyncio.get_running_loop().time()

    return vclock.run(scenario()), node


def test_stage_0_waits_for_its_partners_and_its_next_hop_and_not_for_later_stages():
    took, node = waited({3.0: (0, "Qpartner"), 7.5: (1, "Qa"), 9.0: (1, "Qb"), 30.0: (2, "Qlate")})
    assert 9.0 <= took < 10.5
    assert node._training_since is not None  # the utilisation clock starts when steps can


def test_a_node_that_waits_for_nobody_starts_at_once():
    took, _ = waited({}, want=0)
    assert took == 0


def test_peers_that_never_come_cost_the_startup_timeout_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="swarm_node.node"):
        took, node = waited({2.0: (0, "Qpartner")}, timeout_s=20.0)
    assert 20.0 <= took < 21.5
    assert "starting without all peers: stage(s) 1 have fewer than 2" in caplog.text
    assert node._training_since is not None
