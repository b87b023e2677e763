"""Two ends of direct lanes (net/lanes.py) for tests, each on a test-bed host of its own.

    python lane_peer.py serve --host IP --maddr-file PATH
        writes its multiaddr to PATH, then answers FORWARD (over a lane) and STATUS (over
        libp2p) with its lane server's connections by address key and its open lanes
    python lane_peer.py call --host IP --maddr-file PATH --lanes N
        (started at the same time: it waits for PATH) N times: one FORWARD request on a
        new lane, the lane closed, then STATUS until the server has seen it close; prints
        one JSON line: what the server counted during each request and after each close,
        lanes opened, and whether lanes are still on"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from swarm_node.net import protocols
from swarm_node.net.transport import ServeLimits, Transport

LIMITS = ServeLimits(max_request_bytes=1024)
COUNTS_BYTES = 1 << 16


async def serve(args) -> None:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    transport = Transport(p2p)

    async def counts(remote: str, request: bytes) -> bytes:
        server = transport._lane_server
        counts = {"by_address": dict(server._by_address), "lanes": sum(server._inbound.values())}
        return json.dumps(counts).encode()

    await transport.serve(protocols.FORWARD, counts, LIMITS)
    await transport.serve(protocols.STATUS, counts, LIMITS)
    await transport.open_lanes([args.host], 0)
    staged = args.maddr_file.with_suffix(".tmp")
    staged.write_text(str((await p2p.get_visible_maddrs())[0]))
    staged.rename(args.maddr_file)
    await asyncio.Event().wait()  # until the test stops this host


async def call(args) -> None:
    deadline = time.monotonic() + 60
    while not args.maddr_file.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling for the server's start, which runs beside ours
    target = args.maddr_file.read_text()
    p2p = await P2P.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=[Multiaddr(target)])
    transport = Transport(p2p)
    await transport.open_lanes([args.host], 0)
    peer = target.rsplit("/p2p/", 1)[1]

    async def ask(protocol: str) -> dict:
        answer = await transport.request(peer, protocol, b"?", timeout_s=30, max_response_bytes=COUNTS_BYTES)
        return json.loads(answer)

    during, after, started = [], [], time.monotonic()
    for _ in range(args.lanes):
        during.append((await ask(protocols.FORWARD))["by_address"])
        for lane in transport.lanes._idle.pop(peer, []):  # what the caller does to a lane left idle
            transport.lanes.discard(peer, lane)
        deadline = time.monotonic() + 10
        while (state := await ask(protocols.STATUS))["lanes"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling: the server sees the lane's end when its read returns
        after.append(state["by_address"])
    print(json.dumps({"during": during, "after": after, "lanes_opened": transport.lanes.lanes_opened,
                      "direct": transport.lanes.direct_to(peer),
                      "seconds": round(time.monotonic() - started, 2)}), flush=True)
    await transport.close_lanes()
    await p2p.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "call"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--maddr-file", type=Path, required=True)
    parser.add_argument("--lanes", type=int, default=100)
    parsed = parser.parse_args()
    asyncio.run(serve(parsed) if parsed.role == "serve" else call(parsed))
