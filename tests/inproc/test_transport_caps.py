"""The stream gate's caps over real libp2p streams: one caller cannot hold more than
max_per_peer handlers at once (the rest are told `busy`, and busy is not a fault), a
frame over the size cap is refused before its body is read, and a handler that runs
past its deadline frees its slot. Another caller is served throughout."""

import asyncio

import pytest

from swarm_node.errors import PeerError, PeerRefused
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.transport import ServeLimits, Transport

PROTOCOL = "swarm-node/test-caps/1"


def test_per_peer_concurrency_size_and_time_caps_hold_and_others_are_still_served():
    async def scenario():
        server, greedy, polite = [await SwarmDHT.start() for _ in range(3)]
        try:
            serving = Transport(await server.replicate_p2p())
            running = 0
            peak = 0
            release = asyncio.Event()

            async def slow(remote: str, request: bytes) -> bytes:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                try:
                    if request == b"hold":
                        await release.wait()
                    if request == b"forever":
                        await asyncio.Event().wait()
                    return b"ok"
                finally:
                    running -= 1

            await serving.serve(PROTOCOL, slow, ServeLimits(max_request_bytes=1024, max_concurrent=16, max_per_peer=4,
                                                            handler_timeout_s=2.0))
            for client in (greedy, polite):
                await client.rebootstrap(server.visible_maddrs())
            greedy_t, polite_t = Transport(await greedy.replicate_p2p()), Transport(await polite.replicate_p2p())

            def call(transport, payload, timeout_s=20.0):
                return transport.request(server.peer_id, PROTOCOL, payload, timeout_s=timeout_s,
                                         max_response_bytes=1024)

            held = [asyncio.create_task(call(greedy_t, b"hold")) for _ in range(10)]
            async with asyncio.timeout(30):  # until the server holds 4 and has answered the rest
                while running < 4 or sum(t.done() for t in held) < 6:
                    await asyncio.sleep(0.02)
            held_at_once = running
            polite_answer = await call(polite_t, b"hi")  # another caller gets a slot meanwhile
            release.set()
            results = await asyncio.gather(*held, return_exceptions=True)
            with pytest.raises(PeerError):  # 2 KiB against a 1 KiB cap
                await call(polite_t, b"x" * 2048, timeout_s=10)
            with pytest.raises(PeerError):  # cut off at the handler deadline
                await call(polite_t, b"forever", timeout_s=10)
            after = await call(greedy_t, b"again")
            return peak, held_at_once, polite_answer, results, after, running
        finally:
            for d in (server, greedy, polite):
                await d.shutdown()

    peak, held_at_once, polite_answer, results, after, running = asyncio.run(asyncio.wait_for(scenario(), 120))
    served = [r for r in results if r == b"ok"]
    refused = [r for r in results if isinstance(r, PeerRefused)]
    assert held_at_once == 4 and peak == 5  # the greedy caller's 4, then the polite one
    assert len(served) == 4 and len(refused) == 6
    assert polite_answer == b"ok" and after == b"ok" and running == 0
