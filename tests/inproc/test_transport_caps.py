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

            await serving.serve(PROTOCOL, slow,
                                ServeLimits(max_request_bytes=1024, max_concurrent=16, max_per_peer=4,
                                            handler_timeout_s=2.0))
            for client in (greedy, polite):
                await client.rebootstrap(server.visible_maddrs())
            greedy_t, polite_t = (
                Transport(await greedy.replicate_p2p()),
                Transport(await polite.replicate_p2p()),
            )

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

    peak, held_at_once, polite_answer, results, after, running = asyncio.run(asyncio.wait_for(scenario(),
                                                                                              120))
    served = [r for r in results if r == b"ok"]
    refused = [r for r in results if isinstance(r, PeerRefused)]
    assert held_at_once == 4 and peak == 5  # the greedy caller's 4, then the polite one
    assert len(served) == 4 and len(refused) == 6
    assert polite_answer == b"ok" and after == b"ok" and running == 0


def test_silent_or_oversize_callers_free_their_slots_quickly_and_are_counted_as_faults():
    """A caller that opens streams and sends nothing held every forward slot for the whole
    handler deadline (a red team's 9 identities x 4 streams held 94 streams for 60 s).
    Now a request must start within first_bytes_timeout_s: the slot is freed, the caller
    counted as a fault, and honest callers are served meanwhile."""
    from hivemind.p2p import PeerID

    async def scenario():
        server, stalling, polite = [await SwarmDHT.start() for _ in range(3)]
        faults = []
        try:
            serving = Transport(await server.replicate_p2p(), on_fault=lambda peer,
                                why: faults.append((peer, why)))

            async def echo(remote: str, request: bytes) -> bytes:
                return request

            await serving.serve(PROTOCOL, echo, ServeLimits(max_request_bytes=1024, max_concurrent=4,
                                                            max_per_peer=4, handler_timeout_s=60.0,
                                                            first_bytes_timeout_s=1.0))
            for client in (stalling, polite):
                await client.rebootstrap(server.visible_maddrs())
            stalling_p2p = await stalling.replicate_p2p()
            polite_t = Transport(await polite.replicate_p2p())
            loop = asyncio.get_running_loop()
            started = loop.time()
            silent = [await stalling_p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id),
                                                                    PROTOCOL)
                      for _ in range(4)]  # every slot, nothing sent
            while True:  # told "busy" while the silent streams hold every slot
                try:
                    answer = await polite_t.request(server.peer_id, PROTOCOL, b"hi", timeout_s=30.0,
                                                    max_response_bytes=64)
                    break
                except PeerRefused:
                    await asyncio.sleep(0.2)
            served_after_s = loop.time() - started
            oversize = (5000).to_bytes(8, "big")  # a length prefix over the 1 KiB cap
            _, _, writer = await stalling_p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id),
                                                                         PROTOCOL)
            writer.write(oversize)
            await writer.drain()
            async with asyncio.timeout(10):
                while len(faults) < 5:
                    await asyncio.sleep(0.05)
            for _, _, w in silent:
                w.close()
            return answer, served_after_s, faults
        finally:
            for d in (server, stalling, polite):
                await d.shutdown()

    answer, served_after_s, faults = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answer == b"hi" and served_after_s < 15.0  # not the 60 s handler deadline
    reasons = [why for _, why in faults]
    assert sum("stalled" in why for why in reasons) == 4 and any("exceeds the cap" in why for why in reasons)
    assert len({peer for peer, _ in faults}) == 1  # all charged to the stalling caller


def test_a_silent_stream_told_busy_is_a_stall_too():
    """A silent stream that arrives while every slot is taken goes down the busy path; it
    used to wait there for the drain deadline and leave uncounted, so a caller could stall
    without cost whenever the server was full (and the test above missed a fault when the
    daemon handed the server a silent stream after the polite caller's)."""
    from hivemind.p2p import PeerID

    async def scenario():
        server, stalling, holder = [await SwarmDHT.start() for _ in range(3)]
        faults = []
        try:
            serving = Transport(await server.replicate_p2p(), on_fault=lambda peer,
                                why: faults.append((peer, why)))
            release, holding = asyncio.Event(), asyncio.Event()

            async def hold(remote: str, request: bytes) -> bytes:
                holding.set()
                await release.wait()
                return request

            await serving.serve(PROTOCOL, hold, ServeLimits(max_request_bytes=1024, max_concurrent=1,
                                                            first_bytes_timeout_s=1.0))
            for client in (stalling, holder):
                await client.rebootstrap(server.visible_maddrs())
            held = asyncio.create_task(Transport(await holder.replicate_p2p()).request(
                server.peer_id, PROTOCOL, b"mine", timeout_s=30.0, max_response_bytes=64))
            await asyncio.wait_for(holding.wait(), 30)  # the only slot is taken
            stalling_p2p = await stalling.replicate_p2p()
            _, _, silent = await stalling_p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id),
                                                                         PROTOCOL)
            async with asyncio.timeout(10):  # 1 s is due
                while not faults:
                    await asyncio.sleep(0.05)
            release.set()
            silent.close()
            return await held, faults
        finally:
            for d in (server, stalling, holder):
                await d.shutdown()

    answer, faults = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answer == b"mine"
    assert [why for _, why in faults] == [f"stalled its {PROTOCOL} request"]


def test_a_caller_that_never_reads_its_paced_answer_frees_its_slot_and_is_counted_as_a_fault():
    """A paced answer waits for the caller's acknowledgements: streams that ask and then
    read nothing held every slot of a paced protocol (the data service, outer fetches)
    until the handler deadline, 60 s, and the time-out was nobody's fault. Now the answer
    stalls by the same rule as a request (net/stalls.py: stall_s without an
    acknowledgement, 3 s here): the slots are freed, the caller charged, and an honest
    caller is served meanwhile."""
    from hivemind.p2p import PeerID

    async def scenario():
        server, stalling, polite = [await SwarmDHT.start() for _ in range(3)]
        faults = []
        try:
            serving = Transport(await server.replicate_p2p(),
                                on_fault=lambda peer, why: faults.append((peer, why)))

            async def give(remote: str, request: bytes) -> bytes:
                return bytes(64 << 10)

            limits = ServeLimits(max_request_bytes=1024, max_concurrent=4, max_per_peer=4,
                                 handler_timeout_s=60.0,
                                 stall_s=3.0, paced_response=True)
            await serving.serve(PROTOCOL, give, limits)
            for client in (stalling, polite):
                await client.rebootstrap(server.visible_maddrs())
            stalling_p2p = await stalling.replicate_p2p()
            polite_t = Transport(await polite.replicate_p2p())
            loop = asyncio.get_running_loop()
            started = loop.time()
            unread = []
            for _ in range(4):  # every slot: a request each, then not a byte read
                _, _, writer = await stalling_p2p.call_binary_stream_handler(
                    PeerID.from_base58(server.peer_id), PROTOCOL)
                writer.write((4).to_bytes(8, "big") + b"give")
                await writer.drain()
                unread.append(writer)
            async with asyncio.timeout(10):  # until the server has taken all four
                while sum(serving._active_per_peer.values()) < 4:
                    await asyncio.sleep(0.05)
            async with asyncio.timeout(30):  # told "busy" while the unread answers hold every slot
                while True:
                    try:
                        answer = await polite_t.request(server.peer_id, PROTOCOL, b"give", timeout_s=30.0,
                                                        max_response_bytes=1 << 20, paced_response=True)
                        break
                    except PeerRefused:
                        await asyncio.sleep(0.2)
            served_after_s = loop.time() - started
            async with asyncio.timeout(10):
                while len(faults) < 4:
                    await asyncio.sleep(0.05)
            for w in unread:
                w.close()
            return answer, served_after_s, faults, stalling.peer_id
        finally:
            for d in (server, stalling, polite):
                await d.shutdown()

    answer, served_after_s, faults, stalling_id = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answer == bytes(64 << 10) and served_after_s < 20.0  # not the 60 s handler deadline
    assert faults == [(str(stalling_id), f"stalled reading its {PROTOCOL} answer")] * 4
