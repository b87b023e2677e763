"""A peer that serves altered dataset bytes, for tests: a real `swarm-node join` that
fetches the run's data honestly and trains like any peer, but says it holds every file
of the dataset and answers every chunk request with one byte flipped (issue 35)."""

from __future__ import annotations

import sys

from swarm_node.cli import main as cli
from swarm_node.data import serve
from swarm_node.wire.frames import decode_frame

honest_handle = serve.DataServer.handle


def claim_everything(manifest) -> bytes:
    """A `have` answer that says every file of the manifest is held whole."""
    count = len(manifest.files())
    return serve.bytes_frame({"ok": True, "count": count}, b"\xff" * ((count + 7) // 8))


async def lying_handle(self, remote: str, request: bytes) -> bytes:
    header = decode_frame(request, serve.REQUEST_LIMITS)[0]
    cache = self.cache()
    if header.get("what") == "have" and cache is not None and cache.manifest is not None:
        return claim_everything(cache.manifest)
    if header.get("what") != "chunk" or cache is None or cache.manifest is None:
        return await honest_handle(self, remote, request)
    entry = cache.manifest.files().get(header.get("name"))
    if entry is None or type(header.get("chunk")) is not int or not 0 <= header["chunk"] < entry.num_chunks():
        return await honest_handle(self, remote, request)
    start, end = entry.chunk_span(header["chunk"], cache.manifest.chunk_bytes)
    data = bytearray(end - start)  # what it does not hold, it makes up
    if cache.has(entry):
        data = bytearray(cache.read_chunk(entry, header["chunk"]))
    data[len(data) // 2] ^= 0x5A
    print(f"liar: altered chunk {header['chunk']} of {entry.name} for {remote[-6:]}", file=sys.stderr,
          flush=True)
    return serve.bytes_frame({"ok": True}, bytes(data))


if __name__ == "__main__":
    serve.DataServer.handle = lying_handle
    sys.exit(cli.main(sys.argv[1:]))
