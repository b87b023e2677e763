"""The swarm-scale simulator (swarm_node/scale) at a small N: the node's own pairing,
exchange, guard, chooser and membership code for two stages of peers on a virtual
clock, in a few seconds a run."""

import asyncio
import random
from collections import Counter

import pytest

from swarm_node.scale.config import ScaleConfig
from swarm_node.scale.network import DhtCosts, Endpoint, Network
from swarm_node.scale.vclock import run
from swarm_node.scale.world import World

SMALL = dict(peers_per_stage=8, inner_steps=10, duration_s=150.0, payload_bytes=2_000_000)


def simulate(**overrides):
    return run(World(ScaleConfig(**(SMALL | overrides))).run())


def test_a_small_swarm_pairs_every_round_and_routes_every_forward():
    figures = simulate()
    assert figures.rounds >= 8 * 2 * 8  # peers x stages x rounds in the window, about
    assert figures.partner_share >= 0.95 and figures.alone_rounds == 0
    assert (
        figures.forwards > 0 and figures.forwards_lost_share == 0.0 and figures.forwards_to_dead_share == 0.0
    )
    assert figures.to_partner_median_s is not None and figures.to_partner_median_s < 5.0
    assert (
        figures.control_by_kind_per_peer_min["pairing"] > 0
        and figures.control_by_kind_per_peer_min["dht-get"] > 0
    )


def test_a_run_is_the_same_for_the_same_seed():
    short = dict(duration_s=60.0)
    first = simulate(seed=3, **short).as_dict()
    assert simulate(seed=3, **short).as_dict() == first
    assert simulate(seed=4, **short).as_dict() != first


def test_crashed_peers_cost_forwards_until_their_records_expire_but_the_live_ones_keep_pairing():
    figures = simulate(crash_per_hour=30.0)
    assert figures.crashes >= 5 and figures.joins >= 5
    assert 0.0 < figures.forwards_to_dead_share < 0.3  # chosen from records that outlive their writers
    assert figures.forwards_lost_share < 0.02  # a failed forward is retried on another peer
    assert figures.partner_share >= 0.85


def test_peers_behind_a_nat_take_stage_zero_and_nobody_routes_to_them():
    figures = simulate(unreachable_share=0.25)
    assert figures.forwards_to_unreachable_share == 0.0
    assert figures.partner_share >= 0.9  # they still pair: they call out to the others


def test_the_barrier_baseline_runs_the_same_population():
    figures = simulate(method="diloco", peers_per_stage=4)
    assert figures.method == "diloco" and figures.rounds > 0 and figures.partner_share >= 0.9


def test_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="at least 2 peers"):
        ScaleConfig(peers_per_stage=1)
    with pytest.raises(ValueError, match="unreachable_share"):
        ScaleConfig(unreachable_share=0.6, stages=2)


def test_with_shards_a_peer_reads_about_as_many_records_whatever_the_stage_size():
    def read(figures):  # registry entries a peer receives a minute
        return figures.registry_ops_per_peer_min["entries_read"]

    short = dict(duration_s=80.0)
    small = simulate(peers_per_stage=8, registry_shards=2, **short)
    large, one_key = (simulate(peers_per_stage=32, registry_shards=shards, **short) for shards in (8, 1))
    assert read(large) < 1.5 * read(small)
    assert read(one_key) > 2.5 * read(small)  # one key a stage: every read brings the whole stage
    # a sample pairs and routes
    assert large.partner_share >= 0.95 and large.forwards > 0 and large.forwards_lost_share == 0.0


def test_warm_registry_reads_are_one_find_at_a_random_replica_and_heartbeats_do_not_walk():
    """The registry's DHT traffic as net/near.py makes it (tests/inproc/test_registry_real_dht.py
    checks the real thing): the replicas share the reads, and only a cold store walks."""
    async def scenario():
        net = Network(random.Random(0), DhtCosts(), (0.0, 0.0), lambda protocol, is_request, n: n)
        for i in range(40):
            net.add(Endpoint(f"peer{i}", rtt_s=0.05, uplink_bps=1e8, downlink_bps=4e8, reachable=True))
        writer = net.endpoints["peer0"].traffic.bytes_by_kind
        for i in range(3):
            await net.dht_store("peer0", "key", {"step": i}, 60.0)
            if i == 0:
                cold = writer["dht-store"] + writer["dht-lookup"]
        warm = (writer["dht-store"] + writer["dht-lookup"] - cold) / 2
        assert warm < cold / 2  # no walk, no dictionary downloaded: the entry to each replica
        holders = net.holders("key")
        reader = next(p for p in net.endpoints if p not in holders)
        lookups, served = [], Counter()
        loop = asyncio.get_running_loop()
        for _ in range(50):
            serving = {h: net.endpoints[h].traffic.bytes_by_kind["dht-serving"] for h in holders}
            looked = net.endpoints[reader].traffic.bytes_by_kind["dht-lookup"]
            found = await net.dht_get(reader, "key", loop.time, sufficient_expiry_s=loop.time())
            assert found["peer0"].value == {"step": 2}
            lookups.append(net.endpoints[reader].traffic.bytes_by_kind["dht-lookup"] - looked)
            served.update(
                h for h in holders if net.endpoints[h].traffic.bytes_by_kind["dht-serving"] > serving[h]
            )
        assert set(lookups[1:]) == {net.costs.find_bytes(40)}  # one find each once the replicas are known
        assert len(served) == len(holders) and max(served.values()) <= 25, served  # about 10 each

    run(scenario())


def test_a_peer_busy_with_its_rounds_compute_refuses_proposals_busy():
    """The outer round's compute (the model-free stage's is instant) as a real run
    measured it: peers exchanging or preparing are busy when others propose, as 4 in 10
    of the real refusals were (bench/scale/processes.py calibrates with it)."""
    def busy_refusals(**work):
        world = World(ScaleConfig(**(SMALL | dict(duration_s=90.0) | work)))
        figures = run(world.run())
        assert figures.partner_share >= 0.95
        return sum(p.stats.proposals_refused_busy for p in world.peers.values())

    instant = busy_refusals()  # only while payloads cross the links (2 MB, 5-500 Mbit/s)
    assert busy_refusals(round_prepare_s=0.5, round_check_s=0.5, round_close_s=0.3) >= 2 * instant > 0
