"""Helpers of the in-process data tests: a prepared host folder, a fake transport that
answers with in-process handlers, honest and lying servers, and a fetcher on a cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarm_node.data.cache import ShardCache
from swarm_node.data.fetch import DataFetcher
from swarm_node.data.prepare import PrepareConfig, prepare
from swarm_node.data.serve import DataServer, bytes_frame
from swarm_node.errors import PeerRefused, PeerTimeout, ProtocolError, StreamClosed
from swarm_node.wire.frames import decode_frame, encode_frame

CHUNK = 16 << 10


def prepared_host(tmp_path_factory):
    """The bundled corpus prepared in a folder of its own: (folder, manifest, its hash)."""
    out = tmp_path_factory.mktemp("host")
    manifest, digest = prepare(PrepareConfig(source="corpus", out_dir=out, shard_tokens=100_000,
                                             chunk_bytes=CHUNK,
                                             progress=False, sources=("http://127.0.0.1:1/none",)))
    return out, manifest, digest


class FakeNet:
    """request() as the transport has it, answered by in-process handlers; counts calls.
    Like the transport: a deadline on each call, an answer over the cap refused."""

    def __init__(self):
        self.handlers: dict[str, object] = {}
        self.calls: list[tuple[str, dict]] = []

    async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, paced_request=False,
                      paced_response=False):
        if peer not in self.handlers:
            raise StreamClosed(f"no peer {peer}")
        self.calls.append((peer, decode_frame(payload)[0]))
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self.handlers[peer]("QmMe", payload)
        except TimeoutError:
            raise PeerTimeout(f"data to {peer} timed out after {timeout_s:.1f}s") from None
        if len(answer) > max_response_bytes:
            raise ProtocolError(f"frame of {len(answer)} bytes exceeds the cap of {max_response_bytes}")
        if not answer:
            raise PeerRefused(f"{peer} is busy")
        return answer


def serving(folder: Path, digest: str) -> DataServer:
    cache = ShardCache(folder, digest, trust_whole_files=True)
    cache.load_manifest()
    return DataServer(lambda: cache, on_fault=lambda peer, why: None)


def not_ready_at_first(server: DataServer):
    """The host before it serves its dataset: its first answer says so, then it serves."""
    asked = []

    async def handle(remote, request):
        asked.append(remote)
        if len(asked) == 1:
            return encode_frame({"ok": False, "error": "not serving that dataset"})
        return await server.handle(remote, request)
    return handle


def liar(honest: DataServer):
    """Holds everything and answers every chunk with altered bytes."""
    async def handle(remote, request):
        header = decode_frame(request)[0]
        answer = await honest.handle(remote, request)
        if header["what"] != "chunk":
            return answer
        meta, tensors = decode_frame(answer)
        data = bytearray(tensors[0].numpy().tobytes())
        data[len(data) // 2] ^= 0xFF
        return bytes_frame({"ok": meta["ok"]}, bytes(data))
    return handle


async def answering_status(remote, request) -> bytes:
    """A running node's answer to a status request (the only kind a test sends it)."""
    assert decode_frame(request)[0]["kind"] == "status"
    return encode_frame({"kind": "status", "ok": True})


def fetcher(tmp_path, digest, net, *, peers=(), initial=("QmBoot",), faults=None, budget=None,
            **options) -> DataFetcher:
    cache = ShardCache(tmp_path / "cache", digest, budget_bytes=budget)
    return DataFetcher(cache, net, peers=lambda: list(peers), initial=list(initial), progress=False,
                       **options,
                       on_fault=lambda peer, why: (faults if faults is not None else []).append((peer, why)))


def claims_everything(honest: DataServer, answer_chunk):
    """A peer that answers `manifest` and `have` as ``honest`` (a server holding every
    file) does, so it claims every file, and answers chunks with ``answer_chunk``."""
    async def handle(remote, request):
        if decode_frame(request)[0].get("what") != "chunk":
            return await honest.handle(remote, request)
        return await answer_chunk(remote, request)
    return handle
