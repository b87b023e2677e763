"""Registry records over real DHTs: each peer's record is signed with its identity key, so
another peer can neither overwrite it nor pass off a record under someone else's id."""

import asyncio

from swarm_node import __version__
from swarm_node.membership.registry import publish_record, read_stage, stage_key
from swarm_node.net.dht import SwarmDHT
from swarm_node.wire.records import PeerRecord


def test_a_peer_cannot_overwrite_or_impersonate_another_peers_registry_record():
    async def scenario():
        honest = await SwarmDHT.start()
        forger = await SwarmDHT.start(initial_peers=honest.visible_maddrs())
        try:
            mine = PeerRecord(stage=1, spec_hash="s", version=__version__, inner_step=40)
            assert await publish_record(honest, "r", mine, ttl_s=60)
            fake = PeerRecord(stage=1, spec_hash="s", version=__version__, inner_step=10**9, throughput=1e9)
            key = stage_key("r", 1)
            # the honest peer's signed entry: the DHT refuses a write not signed by its key
            assert not await forger.store(key, honest._owner, fake.to_wire(), ttl_s=60)
            # an unsigned entry under the honest peer's id is stored, but no reader takes it
            assert await forger.store(key, honest.peer_id, fake.to_wire(), ttl_s=60)
            # the forger's own signed record is its own, and shows up under its own id
            assert await publish_record(forger, "r", PeerRecord(stage=1, spec_hash="s", version=__version__),
                                        60)
            # DHT reads on a loaded machine may miss a replica: read until both signed records show
            async with asyncio.timeout(60):
                while True:
                    records, unreadable = await read_stage(forger, "r", 1)
                    if len(records) >= 2:
                        return records, unreadable, honest.peer_id, forger.peer_id
                    await asyncio.sleep(0.5)
        finally:
            await forger.shutdown()
            await honest.shutdown()

    records, unreadable, honest_id, forger_id = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert not unreadable
    assert set(records) == {honest_id, forger_id}
    assert records[honest_id].inner_step == 40 and records[forger_id].inner_step == 0
