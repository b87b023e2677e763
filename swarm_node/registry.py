"""The per-stage registry in the DHT: where the records live and how they are read.
Each node heartbeats a PeerRecord under ``<run>/stage/<k>`` with its peer id as subkey."""

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
    for peer, value in (await dht.get_subkeys(stage_key(run_id, stage))).items():
        try:
            records[peer] = PeerRecord.from_wire(value)
        except ProtocolError as exc:
            unreadable[peer] = exc
    return records, unreadable
