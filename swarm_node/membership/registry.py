"""The per-stage registry in the DHT: where the records live and how they are read.
Each node heartbeats a PeerRecord under ``<run>/stage/<k>`` in its own signed entry
(subkey ``[owner:<public key>]``): no peer can overwrite or impersonate another's record,
and the peer id a record stands for is the one whose key signed it."""

from __future__ import annotations

import time

from swarm_node.errors import ProtocolError
from swarm_node.net.dht import SwarmDHT
from swarm_node.wire.records import CLOCK_SKEW_S, MAX_RECORD_TTL_S, PeerRecord


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


async def read_stage(dht: SwarmDHT, run_id: str, stage: int) -> tuple[dict[str, PeerRecord], dict[str, ProtocolError]]:
    """Live records of one stage, parsed: (peer -> record, peer -> why its record is refused)."""
    records, unreadable = await _read_entries(dht, run_id, stage)
    return {peer: record for peer, (record, _) in records.items()}, unreadable


async def read_registry(dht: SwarmDHT, run_id: str, num_stages: int) -> tuple[dict[str, PeerRecord],
                                                                             dict[str, ProtocolError]]:
    """Every stage's records, one per peer: the one that expires last. A peer that changed
    its stage while joining leaves its withdrawn guess behind until that expires, and a
    view that merged stages in index order showed it in the wrong stage."""
    newest: dict[str, tuple[PeerRecord, float]] = {}
    refused: dict[str, ProtocolError] = {}
    for stage in range(num_stages):
        records, unreadable = await _read_entries(dht, run_id, stage)
        refused.update(unreadable)
        for peer, (record, expires_at_s) in records.items():
            if peer not in newest or expires_at_s > newest[peer][1]:
                newest[peer] = (record, expires_at_s)
    return {peer: record for peer, (record, _) in newest.items()}, refused


async def _read_entries(dht: SwarmDHT, run_id: str, stage: int) -> tuple[dict[str, tuple[PeerRecord, float]],
                                                                        dict[str, ProtocolError]]:
    records: dict[str, tuple[PeerRecord, float]] = {}
    unreadable: dict[str, ProtocolError] = {}
    # The expiry is the writer's choice: one claiming more than any node publishes (plus
    # a clock error) is a forgery meant to outlive its writer (one claimed an hour).
    latest_expiry_s = time.time() + MAX_RECORD_TTL_S + CLOCK_SKEW_S
    for peer, entry in (await dht.get_signed(stage_key(run_id, stage))).items():
        try:
            if entry.expires_at_s > latest_expiry_s:
                raise ProtocolError(f"it claims to live {entry.expires_at_s - time.time():.0f} s; "
                                    f"nodes publish for at most {MAX_RECORD_TTL_S:.0f} s")
            records[peer] = (PeerRecord.from_wire(entry.value), entry.expires_at_s)
        except ProtocolError as exc:
            unreadable[peer] = exc
    return records, unreadable


async def publish_record(dht: SwarmDHT, run_id: str, record: PeerRecord, ttl_s: float) -> bool:
    return await dht.store_signed(stage_key(run_id, record.stage), record.to_wire(), ttl_s)
