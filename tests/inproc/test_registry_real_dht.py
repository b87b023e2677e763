"""The sharded registry's reads and stores on real hivemind DHTs in this process: a
heartbeat goes to the key's replicas, a read asks one of them at random and still
brings every live record of the shard, and a replica that dies costs a find, not the
read (the simulator's cost model assumes all of it)."""

import asyncio
from collections import Counter

from hivemind.dht.routing import DHTID

from swarm_node import __version__
from swarm_node.membership.registry import Cadence, publish_record, read_shard, shard_of, stage_key
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.near import NUM_REPLICAS
from swarm_node.wire.records import PeerRecord

SHARDS = 2
CADENCE = Cadence.for_shards(SHARDS, heartbeat_s=2.0, poll_s=1.0, ttl_s=15.0)


async def start_publishing(count: int, at_least_per_shard: int = 2) -> list[SwarmDHT]:
    """``count`` DHTs in this process, more while a shard would hold fewer than
    ``at_least_per_shard`` of their records, each with its record in the registry (inner
    step = its index, seeking on even ones); the caller shuts them down.

    Peer ids are random, and so is the shard each record lands in: 6 nodes left one of 2
    shards empty in one run in 32, and a fresh read of an empty shard rightly walks after
    asking every node it knows (nobody holds a copy), which these tests count as a miss."""
    nodes = [await SwarmDHT.start()]
    try:
        while len(nodes) < count or min(_records_per_shard(nodes)) < at_least_per_shard:
            nodes.append(await SwarmDHT.start(initial_peers=nodes[0].visible_maddrs()))
        for i, dht in enumerate(nodes):
            record = PeerRecord(stage=0, spec_hash="f" * 16, version=__version__, inner_step=i,
                                seeking=i % 2 == 0)
            assert await publish_record(dht, "real", record, CADENCE.ttl_s, SHARDS)
    except BaseException:
        for dht in nodes:
            await dht.shutdown()
        raise
    return nodes


def _records_per_shard(nodes: list[SwarmDHT]) -> list[int]:
    shards = Counter(shard_of(d.peer_id, SHARDS) for d in nodes)
    return [shards[s] for s in range(SHARDS)]


def test_a_fresh_copy_read_brings_every_record_of_the_shard():
    async def scenario():
        nodes = await start_publishing(6)
        try:
            by_shard = {s: {d.peer_id for d in nodes if shard_of(d.peer_id,
                                                                 SHARDS) == s} for s in range(SHARDS)}
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
    assert ops.walked_gets == 0 and ops.walked_stores == 0


async def _own_node_id(_dht, node):
    return node.node_id


def test_reads_spread_over_the_replicas_and_survive_one_dying():
    async def scenario():
        nodes = await start_publishing(9)
        try:
            # every heartbeat went to the replicas directly
            assert sum(d.ops.walked_stores for d in nodes) == 0
            ids = {d.peer_id: await d.dht.run_coroutine(_own_node_id, return_future=True) for d in nodes}
            shard = 0
            key_id = DHTID.generate(source=stage_key("real", 0, shard, SHARDS))
            replicas = sorted(nodes, key=lambda d: key_id.xor_distance(ids[d.peer_id]))[:NUM_REPLICAS]
            reader = next(d for d in nodes if d not in replicas)  # holds no copy of its own
            expected = {d.peer_id for d in nodes if shard_of(d.peer_id, SHARDS) == shard}

            async def read_all(times):
                for _ in range(times):
                    found, refused = await read_shard(reader, "real", 0, shard, SHARDS,
                                                      CADENCE.sufficient_expiry_s(reader.wall_now()))
                    assert refused == {} and set(found) == expected
            await read_all(30)
            answered = Counter(reader.answered_by)
            assert reader.ops.walked_gets == 0 and sum(answered.values()) == 30
            # only the replicas were asked for the shard
            assert set(answered) <= {d.peer_id for d in replicas}
            assert len(answered) >= 3 and max(answered.values()) <= 18, answered  # about 6 each
            assert reader.ops.near_finds <= 30 + 2  # warm reads: one find each
            victim = replicas[0]
            await victim.shutdown()
            nodes.remove(victim)
            await read_all(10)
            assert (
                reader.ops.walked_gets == 0 and reader.answered_by[victim.peer_id] == answered[victim.peer_id]
            )
        finally:
            for dht in nodes:
                await dht.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 180))
