"""One side of a bulk transfer, as its own process (so that each side can sit on a host
of the test bed). ``serve`` starts a libp2p peer (p2pd, the node's Transport, with
direct lanes) and a raw TCP sink, prints one JSON line with their addresses, and runs
until its stdin closes. ``measure`` sends ``--megabytes`` to it ``--repeats`` times
each way the benchmark compares and prints one JSON line of seconds per transfer.

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


def raw_send(address: tuple[str, int], payload: bytes, repeats: int) -> list[float]:
    times = []
    with socket.create_connection(address) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats + 1):  # the first warms the connection's window up
            started = time.perf_counter()
            conn.sendall(len(payload).to_bytes(8, "big"))
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise RuntimeError("the raw sink closed")
            times.append(time.perf_counter() - started)
    return times[1:]


async def measure(host: str, to: dict, megabytes: float, repeats: int) -> dict:
    payload = os.urandom(int(megabytes * 1e6))
    out = {"bytes": len(payload), "raw_tcp": await asyncio.to_thread(raw_send, tuple(to["raw"]), payload, repeats)}
    dht = await SwarmDHT.start(initial_peers=[to["maddr"]], host_maddrs=[f"/ip4/{host}/tcp/0"])
    try:
        for path in ("libp2p", "lane"):
            transport = Transport(await dht.replicate_p2p())
            if path == "lane":
                await transport.open_lanes([host], 0)
            for protocol, paced in ((PLAIN, False), (PACED, True)):
                times = []
                for _ in range(repeats + 1):  # the first opens the connection (or lane)
                    started = time.perf_counter()
                    await transport.request(to["peer_id"], protocol, payload, timeout_s=600, max_response_bytes=16,
                                            paced_request=paced)
                    times.append(time.perf_counter() - started)
                out[f"{path}_{'paced' if paced else 'plain'}"] = times[1:]
            if path == "lane":
                out["lanes_opened"] = transport.lanes.lanes_opened
                await transport.close_lanes()
    finally:
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
        print(json.dumps(run_on_fast_loop(measure(args.host, args.to, args.megabytes, args.repeats))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
