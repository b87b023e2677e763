"""The per-stage registry in the DHT: where the records live and how they are read.
Each node heartbeats a PeerRecord under ``<run>/stage/<k>`` in its own signed entry
(subkey ``[owner:<public key>]``): no peer can overwrite or impersonate another's record,
and the peer id a record stands for is the one whose key signed it."""

from __future__ import annotations

from swarm_node.errors import ProtocolError
from swarm_node.net.dht import SwarmDHT
from swarm_node.wire.records import PeerRecord


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


async def read_stage(dht: SwarmDHT, run_id: str, stage: int) -> tuple[dict[str, PeerRecord], dict[str, ProtocolError]]:
    """Live records of one stage, parsed: (peer -> record, peer -> why its record is unreadable)."""
    records: dict[str, PeerRecord] = {}
    unreadable: dict[str, ProtocolError] = {}
    for peer, value in (await dht.get_signed(stage_key(run_id, stage))).items():
        try:
            records[peer] = PeerRecord.from_wire(value)
        except ProtocolError as exc:
            unreadable[peer] = exc
    return records, unreadable


async def publish_record(dht: SwarmDHT, run_id: str, record: PeerRecord, ttl_s: float) -> bool:
    return await dht.store_signed(stage_key(run_id, record.stage), record.to_wire(), ttl_s)
