"""The serving side's stall rule (net/stalls.py), driven with fake streams on a virtual
clock: a caller on a full home link, whose bytes come at a few hundred kbit/s, is served
and never counted as a fault, while one that pauses, trickles, or does not take its
answer is cut and counted, and its slot is freed for others.

Each fake caller's bytes arrive at a pace the test sets (a piece every so many virtual
seconds): the rates are exact, whatever the machine's load."""

import asyncio
import socket
import time

import pytest
import vclock

from swarm_node.net.lane_io import LaneIO, lane_executor
from swarm_node.net.pacing import LENGTH_BYTES as ACK_COUNT_BYTES
from swarm_node.net.transport import LENGTH_BYTES, ServeLimits, Transport

PROTOCOL = "swarm-node/test-stalls/1"
ADDR = "/ip4/10.0.0.7/tcp/4001"  # not loopback: a paced answer is paced, as between hosts
MB = 1 << 20
PIECE = 8 << 10
# One of several streams sharing a full 1-2 Mbit/s uplink: 8 KiB every 0.33 s, ~200 kbit/s.
HONEST_PIECE_S = 0.33


class FakeP2P:
    peer_id = "QmServer"

    async def add_binary_stream_handler(self, protocol, handler):
        self.handler = handler


class Info:
    def __init__(self, peer_id: str, addr: str = ADDR):
        self.peer_id, self.addr = peer_id, addr


class Writer:
    def __init__(self):
        self.data, self.closed = bytearray(), False

    def write(self, data) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Served:
    """A transport serving PROTOCOL under ``limits``: its handler echoes the request's
    length (or answers ``answer``), and every fault is recorded."""

    def __init__(self, limits: ServeLimits, answer: bytes | None = None):
        self.limits, self.answer = limits, answer
        self.faults: list[tuple[str, str]] = []
        self.p2p = FakeP2P()

    async def start(self) -> "Served":
        async def handler(remote: str, request: bytes) -> bytes:
            return self.answer if self.answer is not None else len(request).to_bytes(8, "big")

        transport = Transport(self.p2p, on_fault=lambda peer, why: self.faults.append((peer, why)))
        await transport.serve(PROTOCOL, handler, self.limits)
        return self

    def open(self, peer: str) -> tuple[asyncio.Task, asyncio.StreamReader, Writer]:
        reader, writer = asyncio.StreamReader(), Writer()
        return asyncio.create_task(self.p2p.handler(Info(peer), reader, writer)), reader, writer


async def send_slowly(reader: asyncio.StreamReader, body: bytes, piece: int, every_s: float,
                      declared: int | None = None) -> None:
    """The length prefix at once (``declared``, else the body's), then ``piece`` bytes of
    ``body`` every ``every_s``."""
    reader.feed_data((len(body) if declared is None else declared).to_bytes(LENGTH_BYTES, "big"))
    for start in range(0, len(body), piece):
        await asyncio.sleep(every_s)
        reader.feed_data(body[start:start + piece])


def answer_of(writer: Writer) -> bytes | None:
    """The plain frame the server wrote, once all of it is there."""
    if len(writer.data) < LENGTH_BYTES:
        return None
    length = int.from_bytes(writer.data[:LENGTH_BYTES], "big")
    body = bytes(writer.data[LENGTH_BYTES:])
    return body if len(body) == length else None


def limits(**changes) -> ServeLimits:
    return ServeLimits(max_request_bytes=2 * MB, **changes)


# -- requests ------------------------------------------------------------------------
def test_a_caller_on_a_full_home_link_is_served_and_not_counted_as_a_fault():
    """1 MB (a micro-batch's activations) at 200 kbit/s takes 41 s: the fixed 1 Mbit/s
    deadline (5 s + 8.4 s) cut it and counted a fault; eight such and the caller was
    banned for 10 minutes, for a full link."""
    async def scenario():
        served = await Served(limits()).start()
        task, reader, writer = served.open("QmHome")
        started = asyncio.get_running_loop().time()
        await send_slowly(reader, bytes(MB), PIECE, HONEST_PIECE_S)
        async with asyncio.timeout(5.0):
            while answer_of(writer) is None:
                await asyncio.sleep(0.1)
        took_s = asyncio.get_running_loop().time() - started
        reader.feed_eof()  # the caller read its answer and closed
        await task
        return answer_of(writer), took_s, served.faults

    answer, took_s, faults = vclock.run(scenario())
    assert answer == MB.to_bytes(8, "big") and took_s > 40
    assert faults == []


def test_a_paced_request_on_a_full_home_link_is_served_too():
    """The outer payload is a paced request: the same rule, the bytes counted as the
    server acknowledges them."""
    async def scenario():
        served = await Served(limits(paced_request=True)).start()
        task, reader, writer = served.open("QmHome")
        await send_slowly(reader, bytes(MB // 2), PIECE, HONEST_PIECE_S)
        async with asyncio.timeout(5.0):
            # after the acks
            while not writer.data.endswith((8).to_bytes(8, "big") + (MB // 2).to_bytes(8, "big")):
                await asyncio.sleep(0.1)
        reader.feed_eof()
        await task
        return served.faults

    assert vclock.run(scenario()) == []


def test_a_slow_caller_told_busy_gets_its_busy_answer():
    """The busy answer comes after the whole request (module docstring of transport.py):
    a fixed 5 s drain cut a 1 MB body on a full link, so the caller saw its stream reset
    instead of "busy", and took it for a failed peer."""
    async def scenario():
        served = await Served(limits(max_concurrent=1)).start()
        held, held_reader, _ = served.open("QmHolder")
        held_reader.feed_data((MB).to_bytes(LENGTH_BYTES, "big"))  # holds the only slot while its body comes
        sending = asyncio.create_task(send_slowly(held_reader, bytes(MB), PIECE, HONEST_PIECE_S))
        await asyncio.sleep(0.1)
        task, reader, writer = served.open("QmHome")
        await send_slowly(reader, bytes(MB // 2), PIECE, HONEST_PIECE_S)
        async with asyncio.timeout(5.0):
            while answer_of(writer) is None:
                await asyncio.sleep(0.1)
        await sending
        reader.feed_eof()
        held_reader.feed_eof()
        await asyncio.gather(task, held)
        return answer_of(writer), served.faults

    answer, faults = vclock.run(scenario())
    assert answer == b"" and faults == []  # busy, and nobody at fault


@pytest.mark.parametrize("how", ["pause", "trickle", "forever"])
def test_a_caller_that_pauses_or_trickles_is_cut_and_others_are_served(how):
    """Still no free slot: 30 s without a byte, or a byte every 29 s (behind 32 kbit/s by
    more than 30 s), is a stall, counted against the caller; a steady 64 kbit/s that
    would take minutes for the size it declared is cut at the handler's deadline (60 s),
    not counted: a caller that gave up may still have bytes on their way."""
    async def scenario():
        served = await Served(limits(max_concurrent=1)).start()
        loop = asyncio.get_running_loop()
        task, reader, _ = served.open("QmSlowloris")
        started = loop.time()
        if how == "pause":
            sending = send_slowly(reader, bytes(64 << 10), 64 << 10, 0.0, declared=MB)
        elif how == "trickle":
            sending = send_slowly(reader, bytes(100), 1, 29.0, declared=MB)
        else:
            sending = send_slowly(reader, bytes(MB), 1000, 0.125, declared=2 * MB - 1)
        sender = asyncio.create_task(sending)
        await task
        cut_after_s = loop.time() - started
        sender.cancel()
        other, other_reader, other_writer = served.open("QmOther")  # the slot is free again
        other_reader.feed_data((5).to_bytes(LENGTH_BYTES, "big") + b"hello")
        async with asyncio.timeout(1.0):
            while answer_of(other_writer) is None:
                await asyncio.sleep(0.05)
        other_reader.feed_eof()
        await other
        return cut_after_s, answer_of(other_writer), served.faults

    cut_after_s, other_answer, faults = vclock.run(scenario())
    assert cut_after_s <= {"pause": 31.0, "trickle": 32.0, "forever": 61.0}[how]
    assert other_answer == (5).to_bytes(8, "big")
    assert faults == ([] if how == "forever" else [("QmSlowloris", f"stalled its {PROTOCOL} request")])


def test_a_stream_held_up_behind_the_callers_others_is_not_a_stall():
    """One caller, two streams on its full link: one moves at 200 kbit/s; the other starts
    8 s late (its first bytes queued behind the first stream's) and then waits 40 s (a TCP
    flow in retransmission back-off) before it moves again. The caller's link never went
    quiet: both are served, nobody is at fault."""
    async def scenario():
        served = await Served(limits()).start()
        moving, moving_reader, moving_writer = served.open("QmHome")
        held, held_reader, held_writer = served.open("QmHome")

        async def held_up():
            await asyncio.sleep(8.0)
            await send_slowly(held_reader, bytes(64 << 10), PIECE, 0.1, declared=128 << 10)
            await asyncio.sleep(40.0)
            held_reader.feed_data(bytes(64 << 10))

        await asyncio.gather(send_slowly(moving_reader, bytes(MB), PIECE, HONEST_PIECE_S), held_up())
        async with asyncio.timeout(5.0):
            while answer_of(moving_writer) is None or answer_of(held_writer) is None:
                await asyncio.sleep(0.1)
        for reader in (moving_reader, held_reader):
            reader.feed_eof()
        await asyncio.gather(moving, held)
        return answer_of(moving_writer), answer_of(held_writer), served.faults

    moving_answer, held_answer, faults = vclock.run(scenario())
    assert moving_answer == MB.to_bytes(8, "big") and held_answer == (128 << 10).to_bytes(8, "big")
    assert faults == []


def test_every_slot_a_caller_holds_costs_it_the_floor():
    """The silent streams of a caller whose other stream moves are not cut as silent (they
    may be queued behind it), but each costs 32 kbit/s: one stream at 40 kbit/s does not
    pay for three more, and all four are cut, each a fault."""
    async def scenario():
        served = await Served(limits(max_per_peer=4)).start()
        loop = asyncio.get_running_loop()
        streams = [served.open("QmGreedy") for _ in range(4)]
        started = loop.time()
        sender = asyncio.create_task(send_slowly(streams[0][1], bytes(MB), 1000, 0.2))
        await asyncio.gather(*(task for task, _, _ in streams))
        cut_after_s = loop.time() - started
        sender.cancel()
        return cut_after_s, served.faults

    cut_after_s, faults = vclock.run(scenario())
    assert 30.0 <= cut_after_s <= 60.0  # owed 16 KB/s, paid 5, 480 KB allowed behind
    assert faults == [("QmGreedy", f"stalled its {PROTOCOL} request")] * 4


# -- answers ---------------------------------------------------------------------------
def ack(received: int) -> bytes:
    return received.to_bytes(ACK_COUNT_BYTES, "big") + int(time.monotonic() * 1e6).to_bytes(8, "big")


async def acknowledge(reader: asyncio.StreamReader, writer: Writer, total: int, every_s: float | None,
                      most: int) -> None:
    """A paced answer's reader: every ``every_s`` it acknowledges up to ``most`` more of
    what the server has sent (None: never, holding the stream open); closes after all."""
    acked = 0
    while acked < total:
        await asyncio.sleep(every_s if every_s is not None else 3600.0)
        sent = len(writer.data) - LENGTH_BYTES
        if every_s is not None and sent > acked:
            acked = min(sent, acked + most)
            reader.feed_data(ack(acked))
    reader.feed_eof()  # read it all, and closed


def paced_answer_scenario(ack_every_s: float | None, ack_bytes: int = PIECE, answer_bytes: int = 256 << 10):
    """A paced answer of ``answer_bytes`` to a caller that acknowledges ``ack_bytes`` more
    every ``ack_every_s`` of what the server sent (None: never); then another caller asks.
    Returns (seconds the answer held its slot, the other caller's answer, faults)."""
    async def scenario():
        served = await Served(ServeLimits(max_request_bytes=1024, max_concurrent=1, paced_response=True),
                              answer=bytes(answer_bytes)).start()
        loop = asyncio.get_running_loop()
        task, reader, writer = served.open("QmReader")
        reader.feed_data((4).to_bytes(LENGTH_BYTES, "big") + b"give")
        started = loop.time()

        acks = asyncio.create_task(acknowledge(reader, writer, answer_bytes, ack_every_s, ack_bytes))
        await task
        held_s = loop.time() - started
        acks.cancel()
        other, other_reader, other_writer = served.open("QmOther")  # the slot is free again
        other_reader.feed_data((2).to_bytes(LENGTH_BYTES, "big") + b"hi")
        async with asyncio.timeout(5.0):
            await acknowledge(other_reader, other_writer, answer_bytes, 0.05, answer_bytes)
        await other
        return held_s, served.faults

    return vclock.run(scenario())


def test_a_caller_that_never_acknowledges_its_paced_answer_is_cut_and_counted():
    """It held its slot to the handler deadline (60 s), and the time-out was logged at
    debug only: a free way to block every paced protocol (the data service, outer fetches)."""
    held_s, faults = paced_answer_scenario(ack_every_s=None)
    assert held_s <= 31.0
    assert faults == [("QmReader", f"stalled reading its {PROTOCOL} answer")]


def test_a_caller_that_acknowledges_below_the_floor_is_cut_and_counted():
    """1 KiB a second keeps the answer moving (no pause) but falls behind 32 kbit/s."""
    held_s, faults = paced_answer_scenario(ack_every_s=1.0, ack_bytes=1 << 10)
    assert held_s <= 42.0
    assert faults == [("QmReader", f"stalled reading its {PROTOCOL} answer")]


def test_a_caller_reading_its_paced_answer_on_a_full_link_is_not_at_fault():
    """8 KiB every 0.5 s (128 kbit/s): 256 KiB take 16 s, and nobody is at fault."""
    held_s, faults = paced_answer_scenario(ack_every_s=0.5)
    assert 15.0 <= held_s <= 17.0 and faults == []


# -- a lane counts what it reads on its thread ---------------------------------------
def test_a_lane_counts_the_bytes_its_thread_reads_and_the_rule_sees_them():
    """A lane reads a body whole on its own thread; its count of bytes read is what the
    rule watches. Real time (a thread and a socket pair): a byte every 0.1 s keeps a body
    alive for 3 s under a 2 s pause rule, and stopping stalls it."""
    from swarm_node.net.pacing import Meter
    from swarm_node.net.stalls import Flows, Stalled, StallRule, moved

    async def scenario():
        ours, theirs = socket.socketpair()
        pipe = LaneIO(ours, lane_executor())
        rule, flows = StallRule(stall_s=2.0, min_bytes_per_s=1.0, max_s=30.0), Flows()
        loop = asyncio.get_running_loop()

        async def trickle(count: int):
            for _ in range(count):
                await asyncio.sleep(0.1)  # the pace of the sender, not a synchronisation
                theirs.send(b"x")

        started = loop.time()
        try:
            sender = asyncio.create_task(trickle(30))
            async with flows.watch("QmLane", rule, moved(pipe, Meter())):
                body = await pipe.readexactly(30)
            await sender
            alive_s = loop.time() - started
            with pytest.raises(Stalled):
                async with flows.watch("QmLane", rule, moved(pipe, Meter())):
                    await pipe.readexactly(1)
            return body, alive_s, pipe.received
        finally:
            pipe.close()
            theirs.close()

    body, alive_s, received = asyncio.run(scenario())
    assert body == b"x" * 30 and alive_s > 2.5 and received == 30
