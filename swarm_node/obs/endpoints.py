"""A node's status, for outsiders: over HTTP (``swarm-node join --http-port``: /healthz for
container health checks, /metrics in Prometheus text, /api/status as JSON) and over
libp2p (the ``/swarm-node/status/1.0.0`` protocol, which `swarm-node probe` and any libp2p
implementation can query; docs/PROTOCOL.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Protocol

from swarm_node import __version__
from swarm_node.errors import ProtocolError
from swarm_node.obs.http import Response, StatusServer
from swarm_node.obs.node_metrics import node_metrics_text
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

HEALTHY_STATES = ("training", "finished")
STATUS_REQUEST_LIMITS = FrameLimits(max_header_bytes=1024, max_payload_bytes=0, max_tensors=0)


class StatusSource(Protocol):
    """What the pages show; the node's report (node/report.py) provides it."""

    def status_fields(self) -> dict:
        """What a node tells anyone who asks: cheap to compute, nothing secret."""

    def record(self) -> PeerRecord | None:
        """The record the node publishes; None while it is still joining."""

    def counters(self) -> dict:
        """Counters without the theta digest, which costs a pass over all weights."""

    def health(self) -> tuple[str, bool]:
        """(the node's state, whether its DHT is alive)."""


async def handle_status_request(source: StatusSource, on_fault: Callable[[str, str], None], remote: str,
                                request: bytes) -> bytes:
    """``/swarm-node/status/1.0.0``: a frame with kind "status" in, a frame of status_fields out."""
    try:
        header, _ = decode_frame(request, STATUS_REQUEST_LIMITS)
        if header.get("kind") != "status":
            raise ProtocolError("not a status request")
    except ProtocolError as exc:
        on_fault(remote, f"bad status request ({exc})")
        return encode_frame({"kind": "status", "ok": False, "error": "protocol"})
    return encode_frame({"kind": "status", "ok": True, **source.status_fields()})


class NodeStatus:
    def __init__(self, source: StatusSource):
        self.source = source
        self.server = StatusServer({"/healthz": self.healthz, "/metrics": self.metrics,
                                    "/api/status": self.status})
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        self.port = await self.server.start(host, port)
        log.info("status endpoints: http://%s:%d/healthz, /metrics, /api/status", host, self.port)
        return self.port

    async def close(self) -> None:
        await self.server.close()

    def healthz(self) -> Response:
        state, alive = self.source.health()
        if alive and state in HEALTHY_STATES:
            return Response(200, f"ok: {state}\n".encode())
        return Response(503, f"not ready: {state}{'' if alive else ', DHT down'}\n".encode())

    def metrics(self) -> Response:
        record = self.source.record()
        if record is None:
            return Response(503, b"not ready: still joining\n")
        return Response(200, node_metrics_text(record, self.source.counters(),
                                               run_id=self.source.status_fields()["run_id"],
                                               version=__version__).encode(),
                        "text/plain; version=0.0.4; charset=utf-8")

    def status(self) -> Response:
        record = self.source.record()
        body = {**self.source.status_fields(), "record": record.to_wire() if record else None,
                "stats": self.source.counters()}
        return Response(200, json.dumps(body).encode(), "application/json")
