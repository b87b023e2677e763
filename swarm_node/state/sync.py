"""State transfer for late joiners (protocol ``/swarm-node/state/1.0.0``).

A donor answers chunk requests from one consistent snapshot of theta, phi, the outer
momentum and its counters, cached for a few minutes under the snapshot's digest. The
joiner fetches the chunks with a progress bar and a deadline, checks the digest over
everything it received, and tries the next donor on any failure. Adam moments are not
transferred: in NoLoCo the inner optimizer state stays local."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.exists import answers_status
from swarm_node.net.transport import ServeLimits, short_id
from swarm_node.node_services import NodeServices
from swarm_node.train.worker import StageWorker, tensor_digest
from swarm_node.wire.codec import FrameLimits, decode_frame, encode_frame
from swarm_node.wire.messages import (
    check_state_chunk,
    check_state_counters,
)
from swarm_node.wire.records import PeerRecord

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
SNAPSHOT_TTL_S = 120.0
MAX_SNAPSHOTS = 4
MAX_DONORS = 3
CHUNK_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 5.0  # a status request: a few hundred bytes
MAX_PROBES = 64  # peers asked at once whether they exist before a download



class StateSync:
    """Both sides of a state transfer for one stage: ``handle`` serves donors' chunks,
    ``download`` fetches a snapshot from the most advanced live peers of the stage."""

    def __init__(self, *, worker: StageWorker, services: NodeServices, spec_hash: str,
                 donors: Callable[[], dict[str, PeerRecord]], timeout_s: float = 120.0, progress: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.worker = worker
        self.compute, self.transport, self.guard, self.stats = (services.compute, services.transport,
                                                                services.guard, services.stats)
        self.spec_hash = spec_hash
        self.donors = donors  # live peers of our stage that can be called
        self.timeout_s = timeout_s
        self.progress = progress
        self.clock = clock
        self._snapshots: dict[str, tuple[float, dict]] = {}

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        await transport.serve(protocols.STATE, self.handle,
                              ServeLimits(max_request_bytes=64 << 10, max_concurrent=4, max_per_peer=1,
                                          handler_timeout_s=self.timeout_s),
                              authorize=authorize)

    # -- donor side ---------------------------------------------------------------
    async def handle(self, remote: str, request: bytes) -> bytes:
        """Chunk ``chunk`` of snapshot ``snapshot`` (a new snapshot when null)."""
        try:
            header, _ = decode_frame(request, FrameLimits(max_payload_bytes=0))
            if header.get("kind") != "state" or header.get("spec") != self.spec_hash:
                raise ProtocolError("not a state request of this run")
            snapshot = await self._snapshot_for(header.get("snapshot"), remote)
            if snapshot is None:
                return encode_frame({"ok": False, "error": "busy or expired"})
            chunks = chunk_indices(snapshot["tensors"])
            index = header.get("chunk", 0)
            if type(index) is not int or not 0 <= index < len(chunks):
                raise ProtocolError("bad chunk index")
            meta = {"ok": True, "snapshot": snapshot["digest"], "chunk": index, "num_chunks": len(chunks),
                    "inner_step": snapshot["inner_step"], "outer_round": snapshot["outer_round"],
                    "last_round_step": snapshot["last_round_step"], "num_tensors": len(snapshot["tensors"])}
            return await self.compute(encode_frame, meta, [snapshot["tensors"][i] for i in chunks[index]])
        except ProtocolError as exc:
            self.guard.fault(remote, f"bad state request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    async def _snapshot_for(self, snap_id: object, remote: str) -> dict | None:
        now = self.clock()
        self._snapshots = {k: v for k, v in self._snapshots.items() if now - v[0] < SNAPSHOT_TTL_S}
        if snap_id is not None:
            entry = self._snapshots.get(snap_id) if isinstance(snap_id, str) else None
            return entry[1] if entry else None
        if len(self._snapshots) >= MAX_SNAPSHOTS:
            return None
        snapshot = await self.compute(self.worker.snapshot)
        self._snapshots[snapshot["digest"]] = (now, snapshot)
        self.stats.served_digests.append(snapshot["digest"])
        log.info("serving state (step %d, digest %s) to %s", snapshot["inner_step"], snapshot["digest"],
                 short_id(remote))
        return snapshot

    # -- joiner side --------------------------------------------------------------
    async def download(self) -> bool:
        """From the most advanced peers of our stage that exist, trying up to three;
        whether it succeeded (when not, the worker's state is untouched)."""
        for donor in (await self._donors())[:MAX_DONORS]:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._download_from(donor)
                return True
            except (PeerError, TimeoutError, ValueError) as exc:
                log.warning("state download from %s failed (%s); trying another donor", short_id(donor), exc)
        return False

    async def _donors(self) -> list[str]:
        """Live peers of our stage that claim to be ahead of us, most advanced first,
        among those that exist: peers we have reached before, and peers that answer a
        status request now. A forged record has nobody behind it: ordered by claimed
        steps, 30 of them claiming the most took every donor slot and a joiner started
        from scratch."""
        own_step = self.worker.inner_step
        claims = {p: r.inner_step for p, r in self.donors().items()
                  if r.inner_step > own_step and not self.guard.is_poisoned(p)}
        by_claim = sorted(claims, key=lambda p: claims[p], reverse=True)
        unknown = [p for p in by_claim if not self.guard.is_verified(p)][:MAX_PROBES]
        await asyncio.gather(*(self._probe(p) for p in unknown))
        return [p for p in by_claim if self.guard.is_verified(p)]

    async def _probe(self, peer: str) -> None:
        if await answers_status(self.transport, peer, PROBE_TIMEOUT_S):
            self.guard.succeeded(peer)
        else:
            self.guard.failed(peer)

    async def _download_from(self, donor: str) -> None:
        limits = FrameLimits(max_payload_bytes=CHUNK_BYTES * 4)
        snap_id, chunk, num_chunks, meta = None, 0, 1, {}
        tensors: list[torch.Tensor] = []
        # theta, phi and momentum in fp32 at most: a donor cannot make us hold more
        expected_tensors = 3 * len(self.worker.params)
        expected_bytes = 3 * 4 * sum(p.numel() for p in self.worker.params) + (1 << 20)
        received = 0
        bar = tqdm(desc=f"state from {short_id(donor)}", unit="chunk", disable=not self.progress)
        try:
            while chunk < num_chunks:
                request = encode_frame({"kind": "state", "spec": self.spec_hash, "snapshot": snap_id,
                                        "chunk": chunk})
                raw = await self.transport.request(donor, protocols.STATE, request, timeout_s=CHUNK_TIMEOUT_S,
                                                   max_response_bytes=limits.max_payload_bytes + (1 << 16))
                meta, part = await self.compute(decode_frame, raw, limits)
                if not meta.get("ok"):
                    raise PeerRefused(str(meta.get("error"))[:200])
                snap_id, num_chunks = check_state_chunk(meta, chunk, snap_id)
                tensors.extend(part)
                received += sum(t.numel() * t.element_size() for t in part)
                if len(tensors) > expected_tensors or received > expected_bytes:
                    raise ProtocolError(f"the donor sent more than this stage's state "
                                        f"({len(tensors)} tensors, {received} bytes)")
                chunk += 1
                bar.total = num_chunks
                bar.update(1)
        finally:
            bar.close()
        digest = await self.compute(tensor_digest, tensors)
        if digest != snap_id:
            raise ProtocolError(f"state digest {digest} does not match the donor's {snap_id}")
        inner_step, outer_round, last_round_step = check_state_counters(meta)
        if inner_step <= self.worker.inner_step:
            raise ProtocolError(f"its state (step {inner_step}) is not ahead of ours (step {self.worker.inner_step})")
        await self.compute(self.worker.load_snapshot, inner_step, outer_round, tensors, last_round_step)
        self.stats.downloaded_from = donor
        self.stats.downloaded_digest = digest
        log.info("downloaded state from %s: step %d, round %d, digest %s", short_id(donor), inner_step, outer_round,
                 digest)


def chunk_indices(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Group consecutive tensors into chunks of about CHUNK_BYTES."""
    chunks, current, size = [], [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > CHUNK_BYTES:
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks
