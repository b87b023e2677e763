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
from typing import TYPE_CHECKING

import torch

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.transport import short_id
from swarm_node.train.worker import tensor_digest
from swarm_node.wire.codec import FrameLimits, decode_frame, encode_frame

if TYPE_CHECKING:
    from swarm_node.node import Node

log = logging.getLogger("swarm_node.statesync")

CHUNK_BYTES = 4 << 20
SNAPSHOT_TTL_S = 120.0
MAX_SNAPSHOTS = 4
MAX_DONORS = 3
CHUNK_TIMEOUT_S = 30.0


class StateSync:
    def __init__(self, node: Node):
        self.node = node
        self._snapshots: dict[str, tuple[float, dict]] = {}

    # -- donor side ---------------------------------------------------------------
    async def handle(self, remote: str, request: bytes) -> bytes:
        """Chunk ``chunk`` of snapshot ``snapshot`` (a new snapshot when null)."""
        node = self.node
        try:
            header, _ = decode_frame(request, FrameLimits(max_payload_bytes=0))
            if header.get("kind") != "state" or header.get("spec") != node.spec_hash:
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
            return await node.compute(encode_frame, meta, [snapshot["tensors"][i] for i in chunks[index]])
        except ProtocolError as exc:
            node._peer_fault(remote, f"bad state request ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    async def _snapshot_for(self, snap_id: object, remote: str) -> dict | None:
        now = time.monotonic()
        self._snapshots = {k: v for k, v in self._snapshots.items() if now - v[0] < SNAPSHOT_TTL_S}
        if snap_id is not None:
            entry = self._snapshots.get(snap_id) if isinstance(snap_id, str) else None
            return entry[1] if entry else None
        if len(self._snapshots) >= MAX_SNAPSHOTS:
            return None
        snapshot = await self.node.compute(self.node.worker.snapshot)
        self._snapshots[snapshot["digest"]] = (now, snapshot)
        self.node.stats.served_digests.append(snapshot["digest"])
        log.info("serving state (step %d, digest %s) to %s", snapshot["inner_step"], snapshot["digest"],
                 short_id(remote))
        return snapshot

    # -- joiner side --------------------------------------------------------------
    async def download(self) -> bool:
        """From the most advanced live peers of our stage, trying up to three; whether
        it succeeded (when not, the worker's state is untouched)."""
        node = self.node
        donors = sorted(((r.inner_step, p) for p, r in node.callable_peers(node.stage).items() if r.inner_step > 0),
                        reverse=True)
        for _, donor in donors[:MAX_DONORS]:
            try:
                async with asyncio.timeout(node.config.state_download_timeout_s):
                    await self._download_from(donor)
                return True
            except (PeerError, TimeoutError, ValueError) as exc:
                log.warning("state download from %s failed (%s); trying another donor", short_id(donor), exc)
        return False

    async def _download_from(self, donor: str) -> None:
        from tqdm import tqdm

        node = self.node
        limits = FrameLimits(max_payload_bytes=CHUNK_BYTES * 4)
        snap_id, chunk, num_chunks, meta = None, 0, 1, {}
        tensors: list[torch.Tensor] = []
        # theta, phi and momentum in fp32 at most: a donor cannot make us hold more
        expected_tensors = 3 * len(node.worker.params)
        expected_bytes = 3 * 4 * sum(p.numel() for p in node.worker.params) + (1 << 20)
        received = 0
        bar = tqdm(desc=f"state from {short_id(donor)}", unit="chunk", disable=not node.config.progress)
        try:
            while chunk < num_chunks:
                request = encode_frame({"kind": "state", "spec": node.spec_hash, "snapshot": snap_id,
                                        "chunk": chunk})
                raw = await node.transport.request(donor, protocols.STATE, request, timeout_s=CHUNK_TIMEOUT_S,
                                                   max_response_bytes=limits.max_payload_bytes + (1 << 16))
                meta, part = await node.compute(decode_frame, raw, limits)
                if not meta.get("ok"):
                    raise PeerRefused(str(meta.get("error"))[:200])
                snap_id, num_chunks = _check_chunk_meta(meta, chunk, snap_id)
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
        digest = await node.compute(tensor_digest, tensors)
        if digest != snap_id:
            raise ProtocolError(f"state digest {digest} does not match the donor's {snap_id}")
        counters = [meta.get(k) for k in ("inner_step", "outer_round", "last_round_step")]
        if not all(type(c) is int and 0 <= c < 10**12 for c in counters):
            raise ProtocolError(f"bad counters in the donor's state: {counters}")
        await node.compute(node.worker.load_snapshot, *counters[:2], tensors, counters[2])
        node.stats.downloaded_from = donor
        node.stats.downloaded_digest = digest
        log.info("downloaded state from %s: step %d, round %d, digest %s", short_id(donor), meta["inner_step"],
                 meta["outer_round"], digest)


def _check_chunk_meta(meta: dict, chunk: int, snap_id: str | None) -> tuple[str, int]:
    snapshot, num_chunks = meta.get("snapshot"), meta.get("num_chunks")
    if not isinstance(snapshot, str) or len(snapshot) > 64 or (snap_id is not None and snapshot != snap_id):
        raise ProtocolError("the donor changed or garbled the snapshot id")
    if type(num_chunks) is not int or not 0 < num_chunks <= 100_000 or meta.get("chunk") != chunk:
        raise ProtocolError(f"bad chunk numbering from the donor ({meta.get('chunk')!r} of {num_chunks!r})")
    return snapshot, num_chunks


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
