"""A node's status, for outsiders: over HTTP (``swarm-node join --http-port``: /healthz for
container health checks, /metrics in Prometheus text, /api/status as JSON) and over
libp2p (the ``/swarm-node/status/1.0.0`` protocol, which `swarm-node probe` and any libp2p
implementation can query; docs/PROTOCOL.md)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import TYPE_CHECKING

from swarm_node import __version__
from swarm_node.errors import ProtocolError
from swarm_node.obs.http import Response, StatusServer
from swarm_node.obs.node_metrics import node_metrics_text
from swarm_node.wire.codec import FrameLimits, decode_frame, encode_frame

if TYPE_CHECKING:
    from swarm_node.node import Node

log = logging.getLogger(__name__)

HEALTHY_STATES = ("training", "finished")
STATUS_REQUEST_LIMITS = FrameLimits(max_header_bytes=1024, max_payload_bytes=0, max_tensors=0)


def status_fields(node: Node) -> dict:
    """What a node tells anyone who asks: cheap to compute, nothing secret."""
    spec = node.spec
    return {"run_id": spec.run_id if spec else None, "spec_hash": node.spec_hash, "version": __version__,
            "peer_id": node.peer_id, "stage": node.stage, "num_stages": spec.num_stages if spec else None,
            "state": node._state, "inner_step": node.worker.inner_step if node.worker else 0,
            "outer_round": node.worker.outer_round if node.worker else 0,
            "peers_per_stage": [len(node.live_peers(s)) for s in range(spec.num_stages)] if spec else []}


async def handle_status_request(node: Node, remote: str, request: bytes) -> bytes:
    """``/swarm-node/status/1.0.0``: a frame with kind "status" in, a frame of status_fields out."""
    try:
        header, _ = decode_frame(request, STATUS_REQUEST_LIMITS)
        if header.get("kind") != "status":
            raise ProtocolError("not a status request")
    except ProtocolError as exc:
        node._peer_fault(remote, f"bad status request ({exc})")
        return encode_frame({"kind": "status", "ok": False, "error": "protocol"})
    return encode_frame({"kind": "status", "ok": True, **status_fields(node)})


class NodeStatus:
    def __init__(self, node: Node):
        self.node = node
        self.server = StatusServer({"/healthz": self.healthz, "/metrics": self.metrics, "/api/status": self.status})
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        self.port = await self.server.start(host, port)
        log.info("status endpoints: http://%s:%d/healthz, /metrics, /api/status", host, self.port)
        return self.port

    async def close(self) -> None:
        await self.server.close()

    def _live(self) -> dict:
        """Counters without the theta digest, which costs a pass over all weights."""
        node = self.node
        transport = node.transport
        return {"peer_id": node.peer_id, "stage": node.stage, "status": node.status,
                "bytes_sent": transport.bytes_sent if transport else 0,
                "bytes_received": transport.bytes_received if transport else 0, **asdict(node.stats)}

    def healthz(self) -> Response:
        node = self.node
        state = node._state
        alive = node.dht is not None and node.dht.is_alive()
        if alive and state in HEALTHY_STATES:
            return Response(200, f"ok: {state}\n".encode())
        return Response(503, f"not ready: {state}{'' if alive else ', DHT down'}\n".encode())

    def metrics(self) -> Response:
        node = self.node
        if node.worker is None or node.spec is None:
            return Response(503, b"not ready: still joining\n")
        return Response(200, node_metrics_text(node._record(), self._live(), run_id=node.spec.run_id,
                                               version=__version__).encode(),
                        "text/plain; version=0.0.4; charset=utf-8")

    def status(self) -> Response:
        node = self.node
        record = node._record().to_wire() if node.worker is not None and node.spec is not None else None
        body = {**status_fields(node), "record": record, "stats": self._live()}
        return Response(200, json.dumps(body).encode(), "application/json")
