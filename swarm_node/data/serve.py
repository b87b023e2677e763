"""Serving a prepared dataset (protocol ``/swarm-node/data/1.0.0``): the manifest, the
list of files held whole, and chunks of them. The bootstrap serves the host's prepared
folder; every node serves what its cache holds whole. Requests and answers are frames
(wire/frames.py); file bytes travel as one uint8 tensor, and the caller checks them
against the manifest, so a server is trusted for nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from swarm_node.data.cache import ShardCache
from swarm_node.errors import ProtocolError
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame

log = logging.getLogger(__name__)

WHATS = ("manifest", "have", "chunk")
REQUEST_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=0)
DATA_LIMITS = ServeLimits(max_request_bytes=4096, max_concurrent=16, max_per_peer=4, handler_timeout_s=60.0,
                          paced_response=True)


def data_request(manifest_sha256: str, what: str, name: str | None = None, chunk: int | None = None) -> bytes:
    header = {"kind": "data", "manifest": manifest_sha256, "what": what}
    if name is not None:
        header |= {"name": name, "chunk": chunk}
    return encode_frame(header)


def bytes_frame(header: dict, data: bytes) -> bytes:
    return encode_frame(header, [torch.frombuffer(bytearray(data), dtype=torch.uint8)] if data else [])


class DataServer:
    """Answers DATA requests from ``cache`` (None while this node has no manifest yet)."""

    def __init__(self, cache: Callable[[], ShardCache | None], *, on_fault: Callable[[str, str], None]):
        self.cache = cache
        self.on_fault = on_fault
        self.served_bytes = 0

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        await transport.serve(protocols.DATA, self.handle, DATA_LIMITS, authorize=authorize)

    async def handle(self, remote: str, request: bytes) -> bytes:
        try:
            header, _ = decode_frame(request, REQUEST_LIMITS)
            what = header.get("what")
            if header.get("kind") != "data" or what not in WHATS:
                raise ProtocolError("not a data request")
            cache = self.cache()
            if cache is None or cache.manifest is None or header.get("manifest") != cache.manifest_sha256:
                return encode_frame({"ok": False, "error": "not serving that dataset"})
            if what == "manifest":
                data = await asyncio.to_thread(cache.manifest_bytes)
                self.served_bytes += len(data)
                return bytes_frame({"ok": True}, data)
            if what == "have":
                return encode_frame({"ok": True, "files": await asyncio.to_thread(cache.whole_files)})
            entry = cache.manifest.files().get(header.get("name"))
            index = header.get("chunk")
            if entry is None or type(index) is not int or not 0 <= index < entry.num_chunks():
                raise ProtocolError("no such file or chunk")
            if not await asyncio.to_thread(cache.has, entry):
                return encode_frame({"ok": False, "error": "not held"})
            data = await asyncio.to_thread(cache.read_chunk, entry, index)
            self.served_bytes += len(data)
            return bytes_frame({"ok": True}, data)
        except ProtocolError as exc:
            self.on_fault(remote, f"bad data request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})
