"""Paced bulk bodies (swarm_node/net/pacing.py): the window keeps the queue a transfer
builds near the target while the link stays busy, on slow and on fast links; bodies
arrive whole however they are cut; a receiver that lies about what it read is caught."""

from __future__ import annotations

import asyncio
import math
import random
import socket
import threading
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarm_node.errors import ProtocolError, StreamClosed
from swarm_node.net.lane_io import LaneIO, lane_executor
from swarm_node.net.pacing import (
    ACK_EVERY_BYTES,
    CLOCK_BYTES,
    LENGTH_BYTES,
    Pacer,
    PacerConfig,
    read_paced,
    send_paced,
)

DEFAULT_PACER = PacerConfig()


def simulate(rate_mbit: float, rtt_s: float, body_bytes: int, config: PacerConfig = DEFAULT_PACER,
             reverse_queue_s: Callable[[float], float] = lambda t: 0.0):
    """One paced transfer over a bottleneck link (a FIFO at ``rate_mbit``, ``rtt_s`` of
    propagation), in virtual time; acknowledgements wait ``reverse_queue_s(t)`` more on
    the way back (the other direction's traffic). Returns (seconds, the largest
    queueing delay a chunk saw after the first second, the same for the whole transfer)."""
    rate = rate_mbit * 1e6 / 8
    clock = [0.0]
    pacer = Pacer(config, clock=lambda: clock[0])
    link_free = 0.0
    sent = acked = 0
    # (ack back at, end, written at, queued, read at)
    pending: list[tuple[float, int, float, float, float]] = []
    worst_late = worst = 0.0
    while acked < body_bytes:
        while sent < body_bytes and sent - acked < pacer.window_bytes:
            n = min(config.chunk_bytes, body_bytes - sent)
            start = max(clock[0], link_free)
            link_free = start + n / rate
            sent += n
            queued = start - clock[0]
            read_at = link_free + rtt_s / 2
            # FIFO
            back = max(read_at + rtt_s / 2 + reverse_queue_s(read_at), pending[-1][0] if pending else 0.0)
            pending.append((back, sent, clock[0], queued, read_at))
        at, end, written_at, queued, read_at = pending.pop(0)
        clock[0] = at
        worst = max(worst, queued)
        if written_at > 1.0:
            worst_late = max(worst_late, queued)
        pacer.on_ack(end - acked, read_at + 1000.0 - written_at, clock[0] - written_at)  # clocks 1000 s apart
        acked = end
    return clock[0], worst_late, worst


@pytest.mark.parametrize("rate_mbit, rtt_s", [(2, 0.05), (7, 0.05), (20, 0.1), (100, 0.1), (500, 0.02), (50,
                                                                                                         0.3)])
def test_a_transfer_keeps_the_link_busy_and_its_queue_near_the_target(rate_mbit, rtt_s):
    body = int(rate_mbit * 1e6 / 8 * 20)  # 20 s at the link's rate
    seconds, worst_late, _ = simulate(rate_mbit, rtt_s, body)
    ideal = body / (rate_mbit * 1e6 / 8) + rtt_s
    # the link stays busy (slow start costs about a second)
    assert seconds < 1.15 * ideal + 1.0, (seconds, ideal)
    assert worst_late < 2 * PacerConfig().target_s, worst_late  # what any other stream waits behind it


def test_the_queue_on_the_way_back_does_not_slow_the_transfer():
    """Both payloads of an exchange move at once: our acknowledgements share the
    partner's uplink with its payload, and wait behind it (here 0-0.3 s, changing)."""
    body = int(7e6 / 8 * 20)
    seconds, _, _ = simulate(7, 0.05, body, reverse_queue_s=lambda t: 0.15 + 0.15 * math.sin(t))
    assert seconds < 1.1 * (body / (7e6 / 8)) + 1.0


def test_without_pacing_the_same_transfer_queues_for_seconds():
    """The yardstick: a window that does not react (the whole body at once) makes every
    other stream wait behind the body, 20 s on a 2 Mbit/s link."""
    fixed = PacerConfig(initial_bytes=16 << 20, min_bytes=16 << 20)
    _, _, worst = simulate(2, 0.05, 5_000_000, fixed)
    assert worst > 15.0


async def _stream_pair(kinds: tuple[str, str] = ("loop", "loop")):
    """Two ends of one connection, each (reader, writer): "loop" as asyncio streams,
    "lane" as a direct lane's pipe (its thread runs a paced body whole, net/lane_io.py)."""
    return tuple([await _end(kind, sock) for kind, sock in zip(kinds, socket.socketpair())])


async def _end(kind: str, sock: socket.socket):
    if kind == "lane":
        pipe = LaneIO(sock, lane_executor())
        return pipe, pipe
    return await asyncio.open_connection(sock=sock)


PIPES = [("loop", "loop"), ("lane", "lane"), ("lane", "loop"), ("loop", "lane")]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 300_000), st.integers(0, 2**32 - 1),
       st.sampled_from([None, PacerConfig(chunk_bytes=1000, initial_bytes=ACK_EVERY_BYTES,
                                          min_bytes=ACK_EVERY_BYTES),
                        PacerConfig(chunk_bytes=3000, initial_bytes=ACK_EVERY_BYTES + 1,
                                    min_bytes=ACK_EVERY_BYTES + 1)]))
@example(200_000, 1, PacerConfig(chunk_bytes=1000, initial_bytes=ACK_EVERY_BYTES, min_bytes=ACK_EVERY_BYTES))
@example(3_000_000, 2, None)
@pytest.mark.parametrize("kinds", PIPES)
def test_a_paced_body_arrives_whole_and_the_next_frame_follows_its_last_acknowledgement(kinds, size, seed,
                                                                                        config):
    """Including a sender held at its smallest window for the whole body, and either end
    a lane's pipe: the two ways of sending and receiving speak the same protocol."""
    body = random.Random(seed).randbytes(size)

    async def run():
        (a_reader, a_writer), (b_reader, b_writer) = await _stream_pair(kinds)

        async def receiver():
            length = int.from_bytes(await b_reader.readexactly(LENGTH_BYTES), "big")
            got = await read_paced(b_reader, b_writer, length)
            b_writer.write(b"NEXT")
            await b_writer.drain()
            return got

        # a sender that waits for an acknowledgement that never comes fails here
        async with asyncio.timeout(30):
            receiving = asyncio.create_task(receiver())
            await send_paced(a_writer, a_reader, body, Pacer(config) if config else None,
                             written=lambda: written.append(threading.get_ident()))
            await asyncio.sleep(0)  # a lane's thread hands it to the loop
            assert await a_reader.readexactly(4) == b"NEXT"
            got = await receiving
        for w in (a_writer, b_writer):
            w.close()
        return got

    written: list[int] = []
    assert bytes(asyncio.run(run())) == body
    assert written == [threading.get_ident()]  # once, on the loop


@pytest.mark.parametrize("sender", ["loop", "lane"])
@pytest.mark.parametrize("acks, error", [([0], ProtocolError), ([40_000, 30_000], ProtocolError),
                                         ([10**9], ProtocolError), ([], StreamClosed)])
def test_a_receiver_that_lies_about_what_it_read_is_caught(acks, error, sender):
    """Acknowledgements must rise and never pass what was sent; a stream that ends
    before the last one is closed, not a hang."""
    body = b"x" * 100_000

    async def run():
        (a_reader, a_writer), (b_reader, b_writer) = await _stream_pair((sender, "loop"))
        for ack in acks:
            b_writer.write(ack.to_bytes(LENGTH_BYTES, "big") + (0).to_bytes(CLOCK_BYTES, "big"))
        b_writer.write_eof()  # nothing more from the receiver; it still takes what is sent
        try:
            await send_paced(a_writer, a_reader, body, Pacer())
        finally:
            a_writer.close()
            b_writer.close()

    with pytest.raises(error):
        asyncio.run(run())


def test_a_window_below_the_acknowledgement_step_is_refused():
    """It would wait for an acknowledgement that never comes (a transfer hung this way)."""
    with pytest.raises(ValueError):
        PacerConfig(min_bytes=ACK_EVERY_BYTES - 1, initial_bytes=ACK_EVERY_BYTES)


@pytest.mark.parametrize("receiver", ["loop", "lane"])
def test_the_receiver_acknowledges_in_steps_and_at_the_end(receiver):
    body = b"y" * (3 * ACK_EVERY_BYTES + 5)
    piece = ACK_EVERY_BYTES + 1000

    async def run():
        (a_reader, a_writer), (b_reader, b_writer) = await _stream_pair(("loop", receiver))
        receiving = asyncio.create_task(read_paced(b_reader, b_writer, len(body), keep=False))
        acks = []
        for start in range(0, len(body), piece):  # the next piece only once the last one is acknowledged
            a_writer.write(body[start:start + piece])
            await a_writer.drain()
            acks.append(
                int.from_bytes((await a_reader.readexactly(LENGTH_BYTES + CLOCK_BYTES))[:LENGTH_BYTES], "big")
            )
        assert await receiving == b""
        for w in (a_writer, b_writer):
            w.close()
        return acks

    assert asyncio.run(run()) == [piece, 2 * piece, len(body)]
