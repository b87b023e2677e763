"""A peer that claims to hold every file of the run's dataset and serves none, for tests:
a real `swarm-node join` that fetches the run's data honestly and trains like any peer,
but answers `have` with every file and each chunk request as its mode says:

    python hostile_holder.py --hostile stall JOIN-ARGS...   # never answers, then "not held", in turn
    python hostile_holder.py --hostile bf16 JOIN-ARGS...    # a bfloat16 tensor where bytes go

Each chunk request it meets is printed to stderr: "hostile: MODE chunk N of NAME for PEER"."""

from __future__ import annotations

import asyncio
import itertools
import sys

import torch
from data_liar import claim_everything

from swarm_node.cli import main as cli
from swarm_node.data import serve
from swarm_node.wire.frames import decode_frame, encode_frame

MODES = ("stall", "bf16")
honest_handle = serve.DataServer.handle
_turns = itertools.count()


def hostile(mode: str):
    async def handle(self, remote: str, request: bytes) -> bytes:
        header = decode_frame(request, serve.REQUEST_LIMITS)[0]
        cache = self.cache()
        if cache is None or cache.manifest is None or header.get("what") not in ("have", "chunk"):
            return await honest_handle(self, remote, request)
        if header["what"] == "have":
            return claim_everything(cache.manifest)
        print(f"hostile: {mode} chunk {header.get('chunk')} of {header.get('name')} for {remote[-6:]}",
              file=sys.stderr, flush=True)
        if mode == "bf16":
            return encode_frame({"ok": True}, [torch.zeros(64, dtype=torch.bfloat16)])
        if next(_turns) % 2 == 0:
            await asyncio.sleep(3600)  # until the transport's serving deadline ends it
        return encode_frame({"ok": False, "error": "not held"})
    return handle


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != ["--hostile"] or len(args) < 2 or args[1] not in MODES:
        sys.exit(f"usage: hostile_holder.py --hostile {{{','.join(MODES)}}} JOIN-ARGS...")
    serve.DataServer.handle = hostile(args[1])
    sys.exit(cli.main(args[2:]))
