"""The per-stage registry in the DHT: where the records live and how they are read.
Each node heartbeats a PeerRecord under its stage's key in its own signed entry
(subkey ``[owner:<public key>]``): no peer can overwrite or impersonate another's record,
and the peer id a record stands for is the one whose key signed it.

A stage's records are spread over the run's ``registry_shards`` keys
(``<run>/stage/<k>/<shard>``, the shard a hash of the peer id; one shard is the key
``<run>/stage/<k>`` itself). A DHT read returns a key's whole dictionary, from several
replicas, and every entry carries an RSA key and signature (about 1 kB): one key for a
stage of a thousand peers made every read a megabyte. With shards a read returns the
few peers of one shard, and a node's view of a large stage is a sample, refreshed one
shard at a time (membership/view.py)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass

from swarm_node.errors import ProtocolError
from swarm_node.net.dht import SwarmDHT
from swarm_node.wire.records import CLOCK_SKEW_S, MAX_RECORD_TTL_S, PeerRecord

Entries = dict[str, tuple[PeerRecord, float]]  # peer -> (record, expiry on the wall clock)
READS_AT_ONCE = 16  # shards a whole-stage read (a dashboard's) asks for at once
# A sharded registry is for runs of hundreds of peers a stage, where every heartbeat and
# read moves ~1 kB signed entries and its readers serve each other: there, at least this
# cadence (bench/scale measures it against 10 kB/s a peer). A read is served by one of
# the shard's 5 replicas (net/near.py), and a node is a replica of a few keys, some of
# many: at a read every 3 s, the peers holding the most keys of a 1,024-peer stage
# served 10-18 kB/s (the median peer 4.6). A view of such a stage is a sample either way.
SHARDED_HEARTBEAT_S, SHARDED_POLL_S, SHARDED_TTL_S = 12.0, 6.0, 36.0
FRESH_READ_HEARTBEATS = 1.5  # a sharded read's copy: newest record at most this many heartbeats old


@dataclass(frozen=True)
class Cadence:
    """How often a node publishes and reads the registry, and how long its record lives."""
    heartbeat_s: float
    poll_s: float
    ttl_s: float
    alternate_stages: bool = False  # each read takes one of the stages we work with, in turn
    # A read takes the first copy of a shard whose newest record is at most this old
    # (None: the latest, from every node holding one: net/dht.py says what that costs).
    fresh_read_s: float | None = None
    # Whether a round's start and end are published at once (``seeking``), beside the
    # heartbeats. A sharded view reads a peer's record once in many seconds, so the
    # flag is stale by the time it is read, while rounds pair in a round trip (a
    # proposal pulls a peer past half into its round): the two extra stores a round
    # were a third of a peer's DHT bytes for nothing (bench/scale).
    announce_rounds: bool = True

    def sufficient_expiry_s(self, wall_now_s: float) -> float | None:
        """The DHT expiry a copy's newest record must reach for a read to stop at it."""
        return None if self.fresh_read_s is None else wall_now_s + self.ttl_s - self.fresh_read_s

    @classmethod
    def for_shards(cls, shards: int, heartbeat_s: float, poll_s: float, ttl_s: float) -> Cadence:
        """The node's own settings for a one-key registry; at least the sharded cadence
        for a sharded one (a large run), reading one stage at a time."""
        if shards == 1:
            return cls(heartbeat_s, poll_s, ttl_s)
        heartbeat_s = max(heartbeat_s, SHARDED_HEARTBEAT_S)
        # a shard of a few live peers has a record at most one heartbeat old (jitter 1.2x),
        # unless all of them left: then the read walks on and returns what it finds
        return cls(heartbeat_s, max(poll_s, SHARDED_POLL_S), max(ttl_s, SHARDED_TTL_S), alternate_stages=True,
                   fresh_read_s=heartbeat_s * FRESH_READ_HEARTBEATS, announce_rounds=False)


def suggested_shards(peers_per_stage: int) -> int:
    """About four records a read: the largest power of two at or below peers / 4 (1 for
    a few dozen peers a stage and fewer: one key, the fast cadence)."""
    shards = 1
    while shards * 2 <= peers_per_stage // 4:
        shards *= 2
    return shards


def shard_of(peer_id: str, shards: int) -> int:
    """Which of a stage's ``shards`` keys holds ``peer_id``'s record."""
    if shards == 1:
        return 0
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % shards


def stage_key(run_id: str, stage: int, shard: int = 0, shards: int = 1) -> str:
    return f"{run_id}/stage/{stage}" if shards == 1 else f"{run_id}/stage/{stage}/{shard}"


async def read_shard(dht: SwarmDHT, run_id: str, stage: int, shard: int, shards: int,
                     sufficient_expiry_s: float | None = None) -> tuple[Entries, dict[str, ProtocolError]]:
    """One shard of a stage: (peer -> (record, expiry)), (peer -> why its entry is refused).
    An entry filed under a shard its peer id does not hash to is refused: nobody
    honest writes one, and a flood of them must not fill one small key."""
    records, unreadable = await _read_entries(dht, stage_key(run_id, stage, shard, shards),
                                              sufficient_expiry_s)
    for peer in [p for p in records if shard_of(p, shards) != shard]:
        del records[peer]
        unreadable[peer] = ProtocolError(
            f"its record is filed under shard {shard} of stage {stage}; its peer id "
            f"belongs in shard {shard_of(peer, shards)}"
        )
    return records, unreadable


async def read_stage(dht: SwarmDHT, run_id: str, stage: int, shards: int = 1, max_shards: int | None = None,
                     rng: random.Random | None = None) -> tuple[dict[str, PeerRecord], dict[str,
                                                                                            ProtocolError]]:
    """Live records of one stage, parsed: (peer -> record, peer -> why its record is
    refused); all its shards, or ``max_shards`` of them at random."""
    records, unreadable = await _read_shards(dht, run_id, stage, shards, max_shards, rng)
    return {peer: record for peer, (record, _) in records.items()}, unreadable


async def read_registry(dht: SwarmDHT, run_id: str, num_stages: int, shards: int = 1) -> tuple[
        dict[str, PeerRecord], dict[str, ProtocolError]]:
    """Every stage's records, one per peer: the one that expires last. A peer that changed
    its stage while joining leaves its withdrawn guess behind until that expires, and a
    view that merged stages in index order showed it in the wrong stage."""
    newest: Entries = {}
    refused: dict[str, ProtocolError] = {}
    for stage in range(num_stages):
        records, unreadable = await _read_shards(dht, run_id, stage, shards, None, None)
        refused.update(unreadable)
        for peer, (record, expires_at_s) in records.items():
            if peer not in newest or expires_at_s > newest[peer][1]:
                newest[peer] = (record, expires_at_s)
    return {peer: record for peer, (record, _) in newest.items()}, refused


async def _read_shards(dht: SwarmDHT, run_id: str, stage: int, shards: int, max_shards: int | None,
                       rng: random.Random | None) -> tuple[Entries, dict[str, ProtocolError]]:
    which = list(range(shards))
    if max_shards is not None and max_shards < shards:
        which = (rng or random).sample(which, max_shards)
    records: Entries = {}
    unreadable: dict[str, ProtocolError] = {}
    for start in range(0, len(which), READS_AT_ONCE):
        for found, refused in await asyncio.gather(*(read_shard(dht, run_id, stage, shard, shards)
                                                     for shard in which[start:start + READS_AT_ONCE])):
            records.update(found)
            unreadable.update(refused)
    return records, unreadable


async def _read_entries(dht: SwarmDHT, key: str,
                        sufficient_expiry_s: float | None = None) -> tuple[Entries, dict[str, ProtocolError]]:
    records: Entries = {}
    unreadable: dict[str, ProtocolError] = {}
    # The expiry is the writer's choice: one claiming more than any node publishes (plus
    # a clock error) is a forgery meant to outlive its writer (one claimed an hour).
    now_s = dht.wall_now()
    latest_expiry_s = now_s + MAX_RECORD_TTL_S + CLOCK_SKEW_S
    for peer, entry in (await dht.get_signed(key, sufficient_expiry_s)).items():
        try:
            if entry.expires_at_s > latest_expiry_s:
                raise ProtocolError(f"it claims to live {entry.expires_at_s - now_s:.0f} s; "
                                    f"nodes publish for at most {MAX_RECORD_TTL_S:.0f} s")
            records[peer] = (PeerRecord.from_wire(entry.value), entry.expires_at_s)
        except ProtocolError as exc:
            unreadable[peer] = exc
    return records, unreadable


async def publish_record(dht: SwarmDHT, run_id: str, record: PeerRecord, ttl_s: float,
                         shards: int = 1) -> bool:
    key = stage_key(run_id, record.stage, shard_of(dht.peer_id, shards), shards)
    return await dht.store_signed(key, record.compact_wire(), ttl_s)
