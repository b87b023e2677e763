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
    published = PeerRecord.from_wire(record())
    asyncio.run(publish_record(dht, "r", published, ttl_s=15.0, shards=4))
    # the compact form: fields at their default left out, which every reader fills in
    assert dht.published == [(stage_key("r", 1, shard_of("Qm007", 4), 4), published.compact_wire())]
    assert PeerRecord.from_wire(dht.published[0][1]) == published


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
    # a sharded read stops at the first copy whose newest record is one heartbeat and a half old
    assert dht.sufficient_expiries and all(expiry is not None for expiry in dht.sufficient_expiries)


def test_a_peer_a_read_misses_stays_until_its_record_expires_and_an_expired_one_leaves_at_once():
    """A DHT read merges what the replicas that answered in time hold: on a busy machine
    it returns part of a key, and absence from one read is no sign that a peer left."""
    stored = sharded(PEERS)
    stale = next(iter(stored["r/stage/1/1"]))
    stored["r/stage/1/1"][stale] = Signed(record(), time.time() + 0.5)  # its last heartbeat: it crashed
    dht = FakeDHT("self", stored)
    view = Membership(spec=SPEC, dht=dht, guard=PeerGuard(), config=NodeConfig(), record=lambda: None)
    view.stage = 1  # the last stage: every read is of stage 1
    for _ in range(4):
        asyncio.run(view.refresh())
    assert stale in view.peers[1]
    missed = next(iter(stored["r/stage/1/0"]))
    del stored["r/stage/1/0"][missed]  # a partial read: this replica set did not return it
    for _ in range(4):
        asyncio.run(view.refresh())
    assert missed in view.peers[1]
    time.sleep(0.6)  # real time: the record's expiry is on the wall clock
    asyncio.run(view.refresh())  # reads another shard; the expired record goes anyway
    assert stale not in view.peers[1] and missed in view.peers[1]
    assert len(view.peers[1]) == len(PEERS) - 1


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
