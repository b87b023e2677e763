"""The simulator's DHT cost model (scale/network.py) against what hivemind 1.1.12
measured on 16 real DHT processes (bench/scale/dht_costs.py), and the node's registry
reads that stop at the first fresh copy (membership/registry.py Cadence)."""

import random

from swarm_node.membership.registry import Cadence
from swarm_node.net.dht import LATEST_GET, Traversal
from swarm_node.scale.network import DhtCosts, Endpoint, Network
from swarm_node.scale.vclock import run

RECORD = {"stage": 0, "spec_hash": "0123456789abcdef", "version": "0.1.0", "throughput": 1.0,
          "inner_step": 12345,
          "outer_round": 250, "round_step": 20, "partner_rounds": 240, "local_rounds": 10, "recent_steps": 55,
          "recent_microbatches": 236, "last_error": "", "tokens": 0, "queue": 0, "lost": 0, "loss": None,
          "seeking": False, "state": "training", "reachable": True}  # ~258 msgpack bytes, as measured


def network(peers: int, costs: DhtCosts) -> Network:
    net = Network(random.Random(0), costs, (0.0, 0.0), lambda protocol, request, n: n)
    for i in range(peers):
        net.add(Endpoint(f"p{i}", rtt_s=0.05, uplink_bps=1e8, downlink_bps=1e8, reachable=True))
    return net


async def read_cost(net: Network, key: str, reader: str, sufficient: bool) -> tuple[int, int]:
    """(entries found, the reader's bytes) of one get: the latest, or the first copy
    whose newest entry lives on (any, here)."""
    before = net.endpoints[reader].traffic.total
    found = await net.dht_get(reader, key, lambda: 1e9, 0.0 if sufficient else None)
    return len(found), net.endpoints[reader].traffic.total - before


async def stored(net: Network, key: str, owners: list[str]) -> None:
    for owner in owners:
        await net.dht_store(owner, key, RECORD, ttl_s=300.0)


def test_a_latest_get_in_the_steady_state_costs_what_hivemind_measured():
    async def scenario():
        net = network(16, DhtCosts(cache_push_share=0.67))
        await stored(net, "k", ["p0", "p1", "p2", "p3"])
        for reader in range(16):  # every node has read the key: they all cache it
            await read_cost(net, "k", f"p{reader}", sufficient=False)
        return await read_cost(net, "k", "p7", sufficient=False)

    found, cost = run(scenario())
    assert found == 4
    assert 0.9 * 77_716 <= cost <= 1.1 * 77_716  # measured: 15 finds, the dictionary from all 15


def test_a_get_that_stops_at_the_first_fresh_copy_finds_the_same_for_far_less():
    async def scenario(sufficient: bool):
        net = network(128, DhtCosts())
        await stored(net, "k", ["p0", "p1", "p2", "p3"])
        return await read_cost(net, "k", "p9", sufficient)

    (found_latest, latest), (found_fresh, fresh) = run(scenario(False)), run(scenario(True))
    assert found_latest == found_fresh == 4
    assert fresh * 4 < latest


def test_a_store_downloads_the_dictionary_from_every_holder_its_walk_passes():
    wide, narrow = DhtCosts(store=LATEST_GET), DhtCosts(store=Traversal(1, 5))
    async def scenario(model: DhtCosts) -> int:
        net = network(128, model)
        await stored(net, "k", ["p0", "p1", "p2"])
        for reader in range(10, 128):  # the registry's readers cache what they read
            await read_cost(net, "k", f"p{reader}", sufficient=False)
        before = net.endpoints["p3"].traffic.total
        await stored(net, "k", ["p3"])
        return net.endpoints["p3"].traffic.total - before

    costs = [run(scenario(wide)), run(scenario(narrow))]
    assert costs[1] * 2 < costs[0]


def test_only_a_sharded_registry_reads_fresh_copies():
    assert Cadence.for_shards(1, 2.0, 1.0, 15.0).sufficient_expiry_s(100.0) is None
    sharded = Cadence.for_shards(16, 2.0, 1.0, 15.0)
    assert sharded.sufficient_expiry_s(100.0) == 100.0 + sharded.ttl_s - sharded.fresh_read_s
    assert sharded.fresh_read_s >= sharded.heartbeat_s  # an up-to-date replica always qualifies
    assert sharded.heartbeat_s * 3 <= sharded.ttl_s


def test_only_a_one_key_registry_publishes_each_rounds_start_and_end():
    assert Cadence.for_shards(1, 2.0, 1.0, 15.0).announce_rounds
    # heartbeats only: a read is stale anyway
    assert not Cadence.for_shards(16, 2.0, 1.0, 15.0).announce_rounds
