"""A hostile caller for tests: N fresh identities in one process (one address), each
holding K streams to a protocol of every target that send nothing; a stream the target
cuts is opened again (after a short pause, so the attacker does not spin the test
machine's CPU), until the time is up. Prints one JSON line: streams opened, cut by
the target, and refused at once.

    python silent_caller.py --targets MADDR... --identities 10 --streams 4 --hold 60"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

REOPEN_PAUSE_S = 0.2


async def hold(p2p: P2P, target: PeerID, protocol: str, until: float, counts: dict) -> None:
    while time.monotonic() < until:
        opened = time.monotonic()
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(target, protocol), 10)
            counts["opened"] += 1
            try:
                await asyncio.wait_for(reader.read(), max(0.1, until - time.monotonic()))  # silent until cut
                counts["cut_after_s"].append(round(time.monotonic() - opened, 2))
            except TimeoutError:
                counts["held_to_end"] += 1
            finally:
                writer.close()
        except Exception:  # refused, reset, or the target is gone: try again
            counts["refused"] += 1
        await asyncio.sleep(REOPEN_PAUSE_S)


async def main(args) -> None:
    targets = [Multiaddr(m) for m in args.targets]
    peers = [PeerID.from_base58(m.rsplit("/p2p/", 1)[1]) for m in args.targets]
    identities = [await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"], initial_peers=targets)
                  for _ in range(args.identities)]
    counts = {"opened": 0, "refused": 0, "held_to_end": 0, "cut_after_s": []}
    print(json.dumps({"ready": True}), flush=True)
    until = time.monotonic() + args.hold
    await asyncio.gather(*(hold(p2p, peer, args.protocol, until, counts)
                           for p2p in identities for peer in peers for _ in range(args.streams)))
    cuts = sorted(counts.pop("cut_after_s"))
    print(json.dumps({**counts, "cut": len(cuts),
                      "median_cut_after_s": cuts[len(cuts) // 2] if cuts else None}),
          flush=True)
    for p2p in identities:
        await p2p.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--protocol", default="/swarm-node/forward/3.0.0")
    parser.add_argument("--identities", type=int, default=10)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--hold", type=float, default=60.0)
    asyncio.run(main(parser.parse_args()))
