"""A sharded registry (RunSpec.registry_shards): a stage's records over several DHT
keys, one shard read at a time, the view a sample that keeps what it read until it
expires."""

import asyncio
import time

import pytest
from parts import FakeDHT

from swarm_node import __version__
from swarm_node.errors import ConfigError
from swarm_node.membership.registry import publish_record, read_registry, shard_of, stage_key
from swarm_node.membership.view import Membership
from swarm_node.net.dht import Signed
from swarm_node.net.guard import PeerGuard
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord

SPEC = RunSpec(run_id="r", registry_shards=4)
PEERS = [f"Qm{i:03d}" for i in range(40)]


def record(stage=1, **fields):
    return PeerRecord(stage=stage, spec_hash=SPEC.spec_hash(), version=__version__, **fields).to_wire()


def sharded(peers, stage=1, shards=4, ttl_s=15.0):
    stored = {}
    for peer in peers:
        stored.setdefault(stage_key("r", stage, shard_of(peer, shards), shards), {})[peer] = Signed(
            record(stage), time.time() + ttl_s)
    return stored


def test_shards_split_the_peers_and_one_shard_keeps_the_old_key():
    counts = [sum(shard_of(p, 4) == s for p in PEERS) for s in range(4)]
    assert sum(counts) == len(PEERS) and min(counts) >= 4  # spread, not all in one key
    assert all(shard_of(p, 1) == 0 for p in PEERS) and stage_key("r", 1) == "r/stage/1"
    assert stage_key("r", 1, 3, 4) == "r/stage/1/3"
    with pytest.raises(ConfigError, match="power of two"):
        RunSpec(registry_shards=6)


def test_a_node_publishes_under_its_own_shard():
    dht = FakeDHT("Qm007")
    asyncio.run(publish_record(dht, "r", PeerRecord.from_wire(record()), ttl_s=15.0, shards=4))
    assert dht.published == [(stage_key("r", 1, shard_of("Qm007", 4), 4), record())]


def test_each_read_takes_one_shard_and_the_view_fills_up_over_the_shards():
    dht = FakeDHT("self", sharded(PEERS))
    view = Membership(spec=SPEC, dht=dht, guard=PeerGuard(), config=NodeConfig(), record=lambda: None)
    view.stage = 0  # reads stage 0 and the next, stage 1, in turn: one shard of one stage a read
    seen = []
    for _ in range(8):
        asyncio.run(view.refresh())
        seen.append(len(view.peers.get(1, {})))
    assert seen[0] == 0 and seen[1] < len(PEERS) and seen == sorted(seen) and seen[-1] == len(PEERS)
    assert seen[1] == seen[2] and seen[3] == seen[4]  # stage 0's reads leave stage 1's view as it was


def test_peers_gone_from_a_shard_leave_the_view_when_it_is_read_again_and_expired_ones_at_once():
    stored = sharded(PEERS)
    dht = FakeDHT("self", stored)
    view = Membership(spec=SPEC, dht=dht, guard=PeerGuard(), config=NodeConfig(), record=lambda: None)
    view.stage = 1  # the last stage: every read is of stage 1
    for _ in range(4):
        asyncio.run(view.refresh())
    gone = next(iter(stored["r/stage/1/0"]))
    del stored["r/stage/1/0"][gone]
    stale = next(iter(stored["r/stage/1/1"]))
    stored["r/stage/1/1"][stale] = Signed(record(), time.time() + 0.05)
    for _ in range(4):
        asyncio.run(view.refresh())
    time.sleep(0.1)
    asyncio.run(view.refresh())  # reads another shard; the expired record goes anyway
    assert gone not in view.peers[1] and stale not in view.peers[1]
    assert len(view.peers[1]) == len(PEERS) - 2


def test_a_record_filed_under_another_shard_is_refused_and_logged_once(caplog):
    stored = sharded(PEERS[:8])
    intruder = next(p for p in PEERS[8:] if shard_of(p, 4) != 0)
    stored.setdefault("r/stage/1/0", {})[intruder] = Signed(record(), time.time() + 15)
    view = Membership(spec=SPEC, dht=FakeDHT("self", stored), guard=PeerGuard(), config=NodeConfig(),
                      record=lambda: None)
    for _ in range(3):
        asyncio.run(view.refresh(all_stages=True))
    assert intruder not in view.peers[1] and len(view.peers[1]) == 8
    assert sum("filed under shard 0" in r.getMessage() for r in caplog.records) == 1


def test_a_dashboard_reads_every_shard():
    records, refused = asyncio.run(read_registry(FakeDHT("self", sharded(PEERS)), "r", 2, shards=4))
    assert set(records) == set(PEERS) and not refused
