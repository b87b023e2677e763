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

    async def get_signed(self, key: str) -> dict[str, object]:
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


def _joiner(peer_id: str, spec: RunSpec, peers: dict) -> Node:
    node = Node(spec, NodeConfig())
    node._adopt_spec(spec)
    node.dht = type("D", (), {"peer_id": peer_id})()
    node.peers = peers
    return node


def test_simultaneous_joiners_spread_over_stages_and_agree_on_it():
    spec = RunSpec(run_id="r", model_size="tiny", num_stages=3)  # debug has 2 layers: too few for 3 stages

    def rec(stage, state, throughput=0.0):
        return PeerRecord(stage=stage, spec_hash=spec.spec_hash(), version=__version__, state=state,
                          throughput=throughput)

    # stage 1 has a trained peer; three joiners first guessed stage 0
    base = {1: {"t1": rec(1, "training", 50.0)}}
    joiners = ["Qa", "Qb", "Qc"]
    chosen = {}
    for me in joiners:
        others = {p: rec(0, "joining") for p in joiners if p != me}
        chosen[me] = _joiner(me, spec, {0: others, **base, 2: {}})._assign_stage()
    assert chosen == {"Qa": 0, "Qb": 2, "Qc": 0}  # in peer-id order, each to the emptiest stage
    # ties on peer count go to the stage with less throughput
    tied = {0: {"a": rec(0, "training", 90.0)}, 1: {"b": rec(1, "training", 10.0)}, 2: {"c": rec(2, "training", 40.0)}}
    assert _joiner("Qz", spec, tied)._assign_stage() == 1


def test_joiners_nobody_can_reach_take_stage_0_and_the_others_balance_around_them():
    from swarm_node.net.reach import Reachability

    spec = RunSpec(run_id="r", model_size="tiny", num_stages=2)

    def rec(stage, state, reachable=True):
        return PeerRecord(stage=stage, spec_hash=spec.spec_hash(), version=__version__, state=state,
                          reachable=reachable)

    # Qa (behind a NAT), Qb and Qc join together; one reachable peer already trains stage 1
    everyone = {"Qa": rec(0, "joining", reachable=False), "Qb": rec(0, "joining"), "Qc": rec(1, "joining")}
    chosen = {}
    for me in everyone:
        others = {p: r for p, r in everyone.items() if p != me}
        node = _joiner(me, spec, {0: {p: r for p, r in others.items() if r.stage == 0},
                                  1: {"t1": rec(1, "training"), **{p: r for p, r in others.items() if r.stage == 1}}})
        node.reachability = Reachability(me != "Qa")
        chosen[me] = node._assign_stage()
    assert chosen == {"Qa": 0, "Qb": 0, "Qc": 1}  # Qb would have taken stage 0 anyway; Qc sees Qa there


def test_nobody_routes_proposes_or_downloads_state_from_an_unreachable_peer():
    spec = RunSpec(run_id="r", model_size="tiny", num_stages=2)
    node = _joiner("Qme", spec, {1: {
        "open": PeerRecord(stage=1, spec_hash=spec.spec_hash(), version=__version__),
        "natted": PeerRecord(stage=1, spec_hash=spec.spec_hash(), version=__version__, reachable=False)}})
    assert set(node.live_peers(1)) == {"open", "natted"}
    assert set(node.callable_peers(1)) == {"open"}


def test_joiners_that_did_not_see_each_other_in_time_even_out_one_move_at_a_time():
    """Seen on a busy machine: four volunteers started together split 3 + 1, each having
    seen too few of the others before choosing. Looking again at the stages as announced,
    the newest id of the fullest stage moves, and only it."""
    from swarm_node.net.reach import Reachability

    spec = RunSpec(run_id="r", model_size="tiny", num_stages=2)

    def rec(stage, reachable=True):
        return PeerRecord(stage=stage, spec_hash=spec.spec_hash(), version=__version__, state="joining",
                          reachable=reachable)

    announced = {"Qa": 0, "Qb": 0, "Qc": 0, "Qd": 1}
    moves = {}
    for me, stage in announced.items():
        view = {s: {p: rec(st) for p, st in announced.items() if st == s and p != me} for s in (0, 1)}
        node = _joiner(me, spec, view)
        node.stage = stage
        moves[me] = node._rebalanced_stage()
    assert moves == {"Qa": 0, "Qb": 0, "Qc": 1, "Qd": 1}
    # a joiner behind a NAT never moves: the newest id that can does
    behind = {"Qa": 0, "Qz": 0, "Qb": 0}
    node = _joiner("Qb", spec, {0: {"Qa": rec(0), "Qz": rec(0, reachable=False)}, 1: {}})
    node.stage = 0
    assert node._rebalanced_stage() == 1 and max(behind) == "Qz"
    node.reachability = Reachability(False)
    assert node._rebalanced_stage() == 0
    # balanced within one: nobody moves
    node = _joiner("Qc", spec, {0: {"Qa": rec(0)}, 1: {"Qb": rec(1)}})
    node.stage = 0
    assert node._rebalanced_stage() == 0
