"""The sharded registry's reads and stores on real hivemind DHTs in this process: a store
walks to the key's replicas only, and a read that stops at the first fresh copy still
brings every live record of the shard (the simulator's cost model assumes both)."""

import asyncio

from swarm_node import __version__
from swarm_node.membership.registry import Cadence, publish_record, read_shard, shard_of
from swarm_node.net.dht import SwarmDHT
from swarm_node.wire.records import PeerRecord

SHARDS = 2
CADENCE = Cadence.for_shards(SHARDS, heartbeat_s=2.0, poll_s=1.0, ttl_s=15.0)


def test_a_fresh_copy_read_brings_every_record_of_the_shard():
    async def scenario():
        first = await SwarmDHT.start()
        nodes = [first, *[await SwarmDHT.start(initial_peers=first.visible_maddrs()) for _ in range(5)]]
        try:
            for i, dht in enumerate(nodes):
                record = PeerRecord(stage=0, spec_hash="f" * 16, version=__version__, inner_step=i, seeking=i % 2 == 0)
                assert await publish_record(dht, "real", record, CADENCE.ttl_s, SHARDS)
            by_shard = {s: {d.peer_id for d in nodes if shard_of(d.peer_id, SHARDS) == s} for s in range(SHARDS)}
            reader = nodes[-1]
            for shard, expected in by_shard.items():
                found, refused = await read_shard(reader, "real", 0, shard, SHARDS,
                                                  CADENCE.sufficient_expiry_s(reader.wall_now()))
                assert refused == {} and set(found) == expected, (shard, sorted(found), sorted(expected))
                for peer, (record, _expiry) in found.items():
                    index = [d.peer_id for d in nodes].index(peer)
                    # compact on the wire, whole again on arrival
                    assert record.inner_step == index and record.seeking == (index % 2 == 0)
                    assert record.state == "training" and record.reachable
            return reader.ops
        finally:
            for dht in nodes:
                await dht.shutdown()

    ops = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert ops.gets == SHARDS and ops.stores == 1
