"""One side of a bulk transfer, as its own process (so that each side can sit on a host
of the test bed). ``serve`` starts a libp2p peer (p2pd, the node's Transport, with
direct lanes) and a raw TCP sink, prints one JSON line with their addresses, and runs
until its stdin closes. ``measure`` sends ``--megabytes`` to it ``--repeats`` times
each way the benchmark compares, round by round, and prints one JSON line of seconds per
transfer.

    python -m bench.transport.peer serve --host 127.0.0.1
    python -m bench.transport.peer measure --host 127.0.0.1 --to '<the serve line>'"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

from swarm_node.net import protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.transport import ServeLimits, Transport
from swarm_node.system import run_on_fast_loop

WAYS = (("raw_tcp", "raw TCP (one Python stream)"), ("libp2p_plain", "libp2p stream"),
        ("libp2p_paced", "libp2p stream, paced"), ("lane_plain", "direct lane"),
        ("lane_paced", "direct lane, paced"))
PLAIN = protocols.FORWARD  # a bulk protocol with plain bodies (activations travel so)
PACED = protocols.OUTER  # a bulk protocol with paced bodies (outer payloads travel so)
MAX_BYTES = 1 << 30
RAW_CHUNK = 4 << 20


def raw_sink(host: str) -> int:
    """A TCP server that reads u64 length + body and answers one byte, per connection."""
    listener = socket.create_server((host, 0))

    def serve_one(conn: socket.socket) -> None:
        with conn:
            buffer = bytearray(RAW_CHUNK)
            view = memoryview(buffer)
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                left = int.from_bytes(head, "big")
                while left:
                    got = conn.recv_into(view[:min(left, RAW_CHUNK)])
                    if not got:
                        return
                    left -= got
                conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


async def serve(host: str) -> None:
    dht = await SwarmDHT.start(host_maddrs=[f"/ip4/{host}/tcp/0"])
    transport = Transport(await dht.replicate_p2p())

    async def sink(remote: str, request: bytes) -> bytes:
        return b"k"

    for protocol, paced in ((PLAIN, False), (PACED, True)):
        await transport.serve(protocol, sink, ServeLimits(max_request_bytes=MAX_BYTES, handler_timeout_s=600,
                                                          paced_request=paced))
    lane_port = await transport.open_lanes([host], 0)
    print(json.dumps({"maddr": dht.visible_maddrs()[0], "peer_id": dht.peer_id, "raw": [host, raw_sink(host)],
                      "lane_port": lane_port}), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await transport.close_lanes()
    await dht.shutdown()


class RawSender:
    """One TCP connection to the raw sink, blocking, as one Python stream pushes bytes."""

    def __init__(self, address: tuple[str, int]):
        self._conn = socket.create_connection(address)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, payload: bytes) -> None:
        self._conn.sendall(len(payload).to_bytes(8, "big"))
        self._conn.sendall(payload)
        if self._conn.recv(1) != b"k":
            raise RuntimeError("the raw sink closed")

    def close(self) -> None:
        self._conn.close()


async def measure(host: str, to: dict, megabytes: float, repeats: int) -> dict:
    """Every way is set up first (the DHT, both transports, the raw connection); then each
    round sends one transfer each way, so every way meets the machine in the same state
    (raw TCP measured alone, before the daemons had started, moved 2.0-2.5 GB/s here and
    1.5-1.6 GB/s once they ran, idle; one transfer to the next varies by 2x on these 2
    cores). Round 0 opens the connections and lanes and is not counted."""
    payload = os.urandom(int(megabytes * 1e6))
    raw = RawSender(tuple(to["raw"]))
    dht = await SwarmDHT.start(initial_peers=[to["maddr"]], host_maddrs=[f"/ip4/{host}/tcp/0"])
    libp2p = Transport(await dht.replicate_p2p())
    lane = Transport(await dht.replicate_p2p())
    await lane.open_lanes([host], 0)
    out: dict = {"bytes": len(payload), **{way: [] for way, _ in WAYS}}

    async def one(way: str) -> None:
        started = time.perf_counter()
        if way == "raw_tcp":
            await asyncio.to_thread(raw.send, payload)
        else:
            path, body = way.split("_")
            await (libp2p if path == "libp2p" else lane).request(
                to["peer_id"], PACED if body == "paced" else PLAIN, payload, timeout_s=600,
                max_response_bytes=16,
                paced_request=body == "paced")
        out[way].append(time.perf_counter() - started)

    try:
        for _ in range(repeats + 1):
            for way, _ in WAYS:
                await one(way)
        out = {way: times[1:] if isinstance(times, list) else times for way, times in out.items()}
        out["lanes_opened"] = lane.lanes.lanes_opened
    finally:
        raw.close()
        await lane.close_lanes()
        await dht.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport.peer")
    parser.add_argument("role", choices=("serve", "measure"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--to", type=json.loads, default=None, help="the serve side's JSON line")
    parser.add_argument("--megabytes", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.role == "serve":
        run_on_fast_loop(serve(args.host))
    else:
        print(json.dumps(run_on_fast_loop(measure(args.host, args.to, args.megabytes, args.repeats))),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
