"""A direct lane's pipe (net/lane_io.py): reads ahead into its buffer without losing or
reordering a byte, however the bytes arrive; a request's head and its small body take one
trip to the lane's thread, and a request and the wait for its answer one."""

import asyncio
import random
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_node.net.lane_io import BIG_READ_BYTES, LaneIO, lane_executor
from swarm_node.net.transport import LENGTH_BYTES, write_frame


class CountingLane(LaneIO):
    """Counts the trips to the lane's thread."""

    trips = 0

    async def _in_thread(self, fn, *args):
        self.trips += 1
        return await super()._in_thread(fn, *args)


def _request(name: bytes, body: bytes) -> bytes:
    return bytes([len(name)]) + name + len(body).to_bytes(LENGTH_BYTES, "big") + body


async def _read_request(lane: LaneIO) -> tuple[bytes, bytes]:
    """As the lane server and Transport read one: name length, name, body length, body."""
    head = await lane.read(1)
    name = await lane.readexactly(head[0])
    length = int.from_bytes(await lane.readexactly(LENGTH_BYTES), "big")
    return name, bytes(await lane.readexactly(length))


def _send_in_pieces(sock: socket.socket, data: bytes, seed: int) -> threading.Thread:
    """The far end, sending ``data`` in pieces of random sizes, then closing."""
    def send():
        rng, at = random.Random(seed), 0
        while at < len(data):
            n = rng.choice((1, 7, 300, 20_000, 300_000, 2_000_000))
            sock.sendall(data[at:at + n])
            at += n
        sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.sampled_from([0, 1, 9, 5_000, 300_000,
                                                                                 BIG_READ_BYTES + 3])),
                min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_requests_read_back_whole_and_in_order_however_the_bytes_arrive(requests, seed):
    rng = random.Random(seed)
    sent = [(name, rng.randbytes(size)) for name, size in requests]

    async def run():
        ours, theirs = socket.socketpair()
        lane = LaneIO(ours, lane_executor())
        sender = _send_in_pieces(theirs, b"".join(_request(name, body) for name, body in sent), seed)
        try:
            async with asyncio.timeout(30):
                got = [await _read_request(lane) for _ in sent]
                assert await lane.read(1) == b""  # the far end closed: end of stream, nothing left over
        finally:
            lane.close()
            sender.join(timeout=10)
            theirs.close()
        return got

    assert asyncio.run(run()) == sent


def test_a_stream_closed_mid_body_raises_with_what_came():
    async def run():
        ours, theirs = socket.socketpair()
        lane = LaneIO(ours, lane_executor())
        theirs.sendall(_request(b"x", b"0123456789")[:-4])
        theirs.shutdown(socket.SHUT_WR)
        try:
            with pytest.raises(asyncio.IncompleteReadError) as caught:
                await _read_request(lane)
        finally:
            lane.close()
            theirs.close()
        return caught.value

    error = asyncio.run(run())
    assert error.partial == b"012345" and error.expected == 10


def test_a_request_with_a_small_body_is_one_trip_to_the_thread():
    """Read ahead: the head's three reads and the body's come from one trip (they were
    four: 0.1-4 ms each on two busy cores while the sender waits)."""
    async def run():
        ours, theirs = socket.socketpair()
        lane = CountingLane(ours, lane_executor())
        theirs.sendall(_request(b"forward", b"b" * 50_000))
        try:
            assert await _read_request(lane) == (b"forward", b"b" * 50_000)
        finally:
            lane.close()
            theirs.close()
        return lane.trips

    assert asyncio.run(run()) == 1


def test_a_request_and_the_wait_for_its_answer_are_one_trip():
    async def run():
        ours, theirs = socket.socketpair()
        lane = CountingLane(ours, lane_executor())

        def answer():
            head = theirs.recv(LENGTH_BYTES, socket.MSG_WAITALL)
            body = theirs.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
            theirs.sendall(len(body).to_bytes(LENGTH_BYTES, "big") + body[::-1])

        far = threading.Thread(target=answer, daemon=True)
        far.start()
        try:
            await write_frame(lane, b"abc", read_next=True)
            length = int.from_bytes(await lane.readexactly(LENGTH_BYTES), "big")
            assert await lane.readexactly(length) == b"cba"
        finally:
            far.join(timeout=10)
            lane.close()
            theirs.close()
        return lane.trips

    assert asyncio.run(run()) == 1
