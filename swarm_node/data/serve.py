"""Serving a prepared dataset (protocol ``/swarm-node/data/2.0.0``): the manifest, which
of its files are held whole (a bitmap over the manifest's file order), and chunks of
them. The bootstrap serves the host's prepared folder; every node serves what its cache
holds whole. Requests and answers are frames (wire/frames.py); file bytes travel as one
uint8 tensor, and the caller checks them against the manifest, so a server is trusted
for nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from swarm_node.data.cache import ShardCache
from swarm_node.data.manifest import Manifest
from swarm_node.errors import ProtocolError
from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits
from swarm_node.wire.frames import FrameLimits, decode_frame, encode_frame

log = logging.getLogger(__name__)

WHATS = ("manifest", "have", "chunk")
REQUEST_LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=0)
DATA_LIMITS = ServeLimits(max_request_bytes=4096, max_concurrent=16, max_per_peer=4, handler_timeout_s=60.0,
                          paced_response=True)
MAX_BUDGETS = 4096  # callers whose byte budget is tracked; the least recent are forgotten (refilled)


def data_request(manifest_sha256: str, what: str, name: str | None = None, chunk: int | None = None) -> bytes:
    header = {"kind": "data", "manifest": manifest_sha256, "what": what}
    if name is not None:
        header |= {"name": name, "chunk": chunk}
    return encode_frame(header)


def bytes_frame(header: dict, data: bytes) -> bytes:
    return encode_frame(header, [torch.frombuffer(bytearray(data), dtype=torch.uint8)] if data else [])


def holdings_of(bitmap: bytes, count: object, manifest: Manifest) -> frozenset[str]:
    """The names a `have` answer's bitmap marks; ProtocolError when it does not fit the
    manifest."""
    names = list(manifest.files())
    if count != len(names) or len(bitmap) != (len(names) + 7) // 8:
        raise ProtocolError(f"a holdings bitmap of {len(bitmap)} bytes for {count!r} files; the manifest has "
                            f"{len(names)}")
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=len(names), bitorder="little")
    return frozenset(name for name, bit in zip(names, bits) if bit)


@dataclass(frozen=True)
class BudgetConfig:
    """Bytes per second of answers a caller may take (each bucket holds ``burst_s`` of its
    rate): verified callers each; callers nobody verified each, and all of them together."""
    rate_bytes_s: float = 4 << 20
    unverified_rate_bytes_s: float = 512 << 10
    unverified_total_bytes_s: float = 2 << 20
    burst_s: float = 16.0


class _Bucket:
    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float):
        self.level, self.at = level, at


class ByteBudget:
    """Token buckets of answer bytes: one per caller (bounded table), and one that every
    caller nobody verified shares, so fresh identities together get no more than their
    share and verified peers are served first. A caller whose bucket is empty is told
    "busy" (no fault: an honest peer fetching fast meets it too). An answer may take a
    bucket below zero (one answer always goes out; the debt is repaid before the next)."""

    def __init__(self, config: BudgetConfig, verified: Callable[[str], bool], clock=time.monotonic):
        self.config, self.verified, self.clock = config, verified, clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._unverified = _Bucket(config.unverified_total_bytes_s * config.burst_s, clock())

    def _level(self, bucket: _Bucket, rate: float) -> float:
        now = self.clock()
        bucket.level = min(rate * self.config.burst_s, bucket.level + rate * max(0.0, now - bucket.at))
        bucket.at = now
        return bucket.level

    def _own(self, peer: str) -> tuple[_Bucket, float]:
        rate = self.config.rate_bytes_s if self.verified(peer) else self.config.unverified_rate_bytes_s
        bucket = self._buckets.pop(peer, None)
        if bucket is None:
            bucket = _Bucket(rate * self.config.burst_s, self.clock())
        self._buckets[peer] = bucket
        while len(self._buckets) > MAX_BUDGETS:
            self._buckets.popitem(last=False)
        return bucket, rate

    def allows(self, peer: str) -> bool:
        bucket, rate = self._own(peer)
        if self._level(bucket, rate) <= 0:
            return False
        return self.verified(peer) or self._level(self._unverified, self.config.unverified_total_bytes_s) > 0

    def charge(self, peer: str, nbytes: int) -> None:
        bucket, _ = self._own(peer)
        bucket.level -= nbytes
        if not self.verified(peer):
            self._unverified.level -= nbytes


class DataServer:
    """Answers DATA requests from ``cache`` (None while this node has no manifest yet),
    within ``budget`` when one is given."""

    def __init__(self, cache: Callable[[], ShardCache | None], *, on_fault: Callable[[str, str], None],
                 budget: ByteBudget | None = None):
        self.cache = cache
        self.on_fault = on_fault
        self.budget = budget
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
            if what == "have":
                bitmap = await asyncio.to_thread(cache.holdings)
                return bytes_frame({"ok": True, "count": len(cache.manifest.files())}, bitmap)
            entry = None
            if what == "chunk":
                name, index = header.get("name"), header.get("chunk")
                entry = cache.manifest.files().get(name) if type(name) is str else None
                if entry is None or type(index) is not int or not 0 <= index < entry.num_chunks():
                    raise ProtocolError("no such file or chunk")
            if self.budget is not None and not self.budget.allows(remote):
                return encode_frame({"ok": False, "error": "busy"})
            try:
                if entry is None:
                    data = await asyncio.to_thread(cache.manifest_bytes)
                elif await asyncio.to_thread(cache.servable, entry):
                    data = await asyncio.to_thread(cache.read_chunk, entry, index)
                else:
                    return encode_frame({"ok": False, "error": "not held"})
            except OSError:  # evicted meanwhile (by another node sharing the cache)
                return encode_frame({"ok": False, "error": "not held"})
            self.served_bytes += len(data)
            if self.budget is not None:
                self.budget.charge(remote, len(data))
            return bytes_frame({"ok": True}, data)
        except ProtocolError as exc:
            self.on_fault(remote, f"bad data request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})
