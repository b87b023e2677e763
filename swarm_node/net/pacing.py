"""Bulk bodies that yield to everything else on the link: the receiver acknowledges what
it has read, and the sender keeps only as much unacknowledged as the measured delay
allows (a delay-based window, after LEDBAT, RFC 6817).

Why: libp2p carries every stream between two peers over one connection, and the
buffers along it (the daemon's, yamux's, the kernel's) fill with whatever is written.
An outer payload of a few MB written at once on a 2 Mbit/s uplink sat in front of
every proposal, heartbeat and DHT request to that peer for 10-25 s, and those timed
out. Paced, the bytes waiting anywhere between us and the receiver stay near what the
link carries in ``target_s``: other streams wait about that long, not the whole body.

    paced body (sender -> receiver) := u64 length (big endian) | bytes
    acknowledgements (receiver -> sender) := (u64 bytes received so far | u64 receiver's clock in µs), ...

The receiver acknowledges once it holds ``ACK_EVERY_BYTES`` unacknowledged and has read
what had arrived (at least every ``READ_CHUNK_BYTES`` or so while bytes keep coming), and
once at the end, so the last acknowledgement equals the length and whatever follows on
that direction is the next frame (an empty body has no acknowledgement). On a direct lane
(net/lane_io.py, a ``BlockingPipe``) a body is sent and read whole on the lane's thread,
the same protocol in blocking calls. The sender checks every acknowledgement (rising,
never past what was sent): a receiver that lies gets a ProtocolError, one that never
acknowledges runs into the caller's deadline.

The delay that counts is one way: when the receiver read a byte (its clock, sent with
the acknowledgement) less when we wrote it (ours), over the smallest such difference
seen; the clocks' offset cancels. A round trip would also count the queue on the way
back, where the partner's own payload is moving at the same time: a window measured by
round trips was cut by the other direction's traffic and the fetch ran at 60 % of the
link. The window starts at ``initial_bytes`` and grows by half each round trip while the
queueing delay stays under half the target; after that it grows by up to an eighth a
round trip below the target and shrinks (at most once a round trip, to no less than half)
above it. In a simulation of links from 2 to 1000 Mbit/s and 2 to 300 ms
(tests/unit/test_pacing.py) a transfer keeps the link busy (within 3 %, 10 % at 300 ms)
and what waits behind it waits 0.1-0.15 s. On loopback the sender does not wait for
acknowledgements at all: there is no uplink to share, and a busy machine's scheduling
delays would otherwise read as queueing."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from swarm_node.errors import ProtocolError, StreamClosed

LENGTH_BYTES = 8
CLOCK_BYTES = 8
ACK_EVERY_BYTES = 8 << 10  # at most the smallest window: a sender held at it must see an acknowledgement
READ_CHUNK_BYTES = 256 << 10
GROWTH_PER_RTT = 1 / 8  # below the target: the window grows by up to this share a round trip


@dataclass(frozen=True)
class PacerConfig:
    target_s: float = 0.1  # queueing delay a bulk transfer may add (LEDBAT's bound)
    chunk_bytes: int = 16 << 10
    initial_bytes: int = 64 << 10
    min_bytes: int = 16 << 10
    max_bytes: int = 16 << 20

    def __post_init__(self):
        # the receiver acknowledges every ACK_EVERY_BYTES: a smaller window would wait for
        # an acknowledgement that never comes
        if not ACK_EVERY_BYTES <= self.min_bytes <= self.initial_bytes <= self.max_bytes:
            raise ValueError(f"window bounds must satisfy {ACK_EVERY_BYTES} <= min <= initial <= max")


class Pacer:
    """The window of one transfer: pure arithmetic on (bytes acknowledged, one-way delay
    with an unknown constant added, round trip)."""

    def __init__(self, config: PacerConfig = PacerConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.window_bytes = config.initial_bytes
        self.base_delay_s = float("inf")
        self.slow_start = True
        self._last_cut_s = -float("inf")

    def on_ack(self, acked_bytes: int, delay_s: float, rtt_s: float) -> None:
        c = self.config
        self.base_delay_s = min(self.base_delay_s, delay_s)
        queueing_s = delay_s - self.base_delay_s
        if queueing_s > c.target_s:
            self.slow_start = False
            now = self.clock()
            # one cut a round trip: the samples after it still show the old queue
            if now - self._last_cut_s >= rtt_s:
                self._last_cut_s = now
                self.window_bytes = int(self.window_bytes * max(0.5, c.target_s / queueing_s))
        elif self.slow_start and queueing_s < c.target_s / 2:
            self.window_bytes += acked_bytes // 2
        else:
            self.slow_start = False
            self.window_bytes += int(acked_bytes * GROWTH_PER_RTT * (1 - queueing_s / c.target_s))
        self.window_bytes = min(c.max_bytes, max(c.min_bytes, self.window_bytes))


class Meter:
    """The bytes a body has moved so far, set by whoever moves them (net/stalls.py)."""

    __slots__ = ("bytes",)

    def __init__(self):
        self.bytes = 0


class _Window:
    """A paced sender's bookkeeping: what it has sent and what was acknowledged, the
    window it may have outstanding, and each acknowledgement checked and fed to the pacer."""

    def __init__(self, length: int, pacer: Pacer | None, meter: Meter | None = None):
        self.length, self.pacer, self.meter = length, pacer, meter
        self.clock = pacer.clock if pacer is not None else time.monotonic
        self.sent = self.acked = 0
        self._in_flight: deque[tuple[int, float]] = deque()  # (end offset of a piece, when it was written)

    @property
    def done(self) -> bool:
        return self.acked >= self.length

    def room(self, piece_bytes: int) -> int:
        """How much to write next (0: wait for an acknowledgement)."""
        if self.pacer is None:
            return self.length - self.sent
        window = self.pacer.window_bytes
        if self.sent >= self.length or self.sent - self.acked >= window:
            return 0
        return min(piece_bytes, self.length - self.sent, window - (self.sent - self.acked))

    def wrote(self, n: int) -> None:
        self.sent += n
        self._in_flight.append((self.sent, self.clock()))

    def last_written(self, written: Callable[[], None] | None) -> Callable[[], None] | None:
        """Calls ``written`` once all is written; what is left to call."""
        if written is not None and self.sent >= self.length:
            written()
            return None
        return written

    def on_ack(self, ack: int, read_at_s: float) -> None:
        if not self.acked < ack <= self.sent:
            raise ProtocolError(f"acknowledged {ack} bytes after {self.acked}, of {self.sent} sent")
        written_at = None
        while self._in_flight and self._in_flight[0][0] <= ack:
            written_at = self._in_flight.popleft()[1]
        if self.pacer is not None and written_at is not None:
            self.pacer.on_ack(ack - self.acked, read_at_s - written_at, self.clock() - written_at)
        self.acked = ack
        if self.meter is not None:
            self.meter.bytes = ack


class BlockingPipe(ABC):
    """A connection served by a thread of its own (a direct lane, net/lane_io.py): a paced
    body runs whole on that thread, with blocking calls. Through the event loop, a trip
    per acknowledgement held a lane to a third of its plain speed on loopback and to 95 MB/s
    on a 10 Gbit/s link. A read sends what was written before it first (so a request and
    the wait for its answer are one trip to the thread: transport.write_frame)."""

    received = 0  # bytes read from the connection so far (counted on the pipe's thread)

    @abstractmethod
    async def run(self, fn: Callable, *args):
        """``fn(self, *args)`` on the pipe's thread, after what was written before it."""

    @abstractmethod
    def send_now(self, data: bytes | memoryview) -> None:
        """All of ``data``, blocking; takes in what the other side sent meanwhile."""

    @abstractmethod
    def recv_into_now(self, view: memoryview) -> int:
        """At least one byte into ``view`` (0: the connection closed), blocking."""

    @abstractmethod
    def readable_within(self, timeout_s: float) -> bool:
        """Whether bytes are there to read, waiting up to ``timeout_s`` for them."""

    @abstractmethod
    def buffered(self) -> int:
        """Bytes already read from the connection and not yet taken, after taking in
        whatever has arrived meanwhile (without waiting)."""

    @abstractmethod
    def body_buffer(self, length: int) -> memoryview:
        """Memory for a received body of ``length`` bytes."""


# A paced body on a pipe's thread goes in pieces of up to this (each a timestamp for the
# pacer), and is acknowledged at least this often while bytes keep coming.
PIPE_PIECE_BYTES = READ_CHUNK_BYTES
# Once bytes pause, the receiver waits this long for more before it acknowledges: over TLS
# a read takes one 16 KiB record, and an acknowledgement each (2,500 for 40 MB) held a
# 10 Gbit/s transfer to 180 MB/s. A sender held at its window waits this much longer for
# the acknowledgement, against the tens of milliseconds a window takes on a slow link.
ACK_PAUSE_S = 0.001


async def send_paced(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes,
                     pacer: Pacer | None, meter: Meter | None = None,
                     written: Callable[[], None] | None = None) -> None:
    """Write ``data`` as a paced body and read its acknowledgements to the last one.
    ``pacer`` None: write it all at once (loopback), still reading the acknowledgements.
    ``meter``: counts the bytes acknowledged (a server watches a paced answer stall by it).
    ``written``: called on the loop once the last byte is written (its acknowledgement a
    round trip away: the next body may start)."""
    if isinstance(writer, BlockingPipe):
        loop = asyncio.get_running_loop()
        on_thread = None if written is None else partial(loop.call_soon_threadsafe, written)
        return await writer.run(send_paced_blocking, data, pacer, meter, on_thread)
    window = _Window(len(data), pacer, meter)
    writer.write(len(data).to_bytes(LENGTH_BYTES, "big"))
    view = memoryview(data)
    piece = pacer.config.chunk_bytes if pacer is not None else len(data)
    while not window.done:
        while n := window.room(piece):
            writer.write(view[window.sent:window.sent + n])
            window.wrote(n)
        await writer.drain()
        written = window.last_written(written)
        window.on_ack(*await _read_ack(reader))
    window.last_written(written)  # an empty body


def send_paced_blocking(pipe: BlockingPipe, data: bytes | memoryview, pacer: Pacer | None,
                        meter: Meter | None = None, written: Callable[[], None] | None = None) -> None:
    """``send_paced`` on the pipe's thread (``written`` called on it)."""
    window = _Window(len(data), pacer, meter)
    pipe.send_now(len(data).to_bytes(LENGTH_BYTES, "big"))
    view = byte_view(data)
    ack = bytearray(LENGTH_BYTES + CLOCK_BYTES)
    while not window.done:
        # an eighth of the window a piece: enough timestamps for the pacer, few calls
        piece = PIPE_PIECE_BYTES if pacer is None else max(pacer.config.chunk_bytes,
                                                           min(PIPE_PIECE_BYTES, pacer.window_bytes // 8))
        while n := window.room(piece):
            window.wrote(n)  # stamped as it starts, as the loop's sender stamps its writes
            pipe.send_now(view[window.sent - n:window.sent])
        written = window.last_written(written)
        _read_into(pipe, memoryview(ack))  # at least one, then every one already here
        window.on_ack(*_parse_ack(ack))
        while not window.done and pipe.buffered() >= len(ack):
            _read_into(pipe, memoryview(ack))
            window.on_ack(*_parse_ack(ack))
    window.last_written(written)  # an empty body


async def read_paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int,
                     keep: bool = True, clock: Callable[[], float] = time.monotonic,
                     meter: Meter | None = None) -> bytes:
    """Read a paced body of ``length`` bytes (its length prefix already read and checked
    against the cap), acknowledging as it comes; ``keep`` False reads it and throws it
    away (a busy answer to a caller that is sending anyway). ``meter`` counts what came
    (a pipe counts for itself: BlockingPipe.received)."""
    if isinstance(reader, BlockingPipe):
        return await reader.run(read_paced_blocking, length, keep, clock)
    parts: list[bytes] = []
    received = last_ack = 0
    while received < length:
        part = await reader.read(min(READ_CHUNK_BYTES, length - received))
        if not part:
            raise StreamClosed("stream closed mid-frame")
        received += len(part)
        if meter is not None:
            meter.bytes = received
        if keep:
            parts.append(part)
        if received - last_ack >= ACK_EVERY_BYTES or received == length:
            writer.write(_ack(received, clock))
            last_ack = received
    await writer.drain()
    return b"".join(parts)


def read_paced_blocking(pipe: BlockingPipe, length: int, keep: bool = True,
                        clock: Callable[[], float] = time.monotonic) -> bytes | memoryview:
    """``read_paced`` on the pipe's thread: a big body comes back as a view of the memory
    it was read into. Acknowledged once ACK_EVERY_BYTES or more are unacknowledged and no
    more come within ACK_PAUSE_S (so a sender held at its smallest window gets one), and
    every PIPE_PIECE_BYTES while they keep coming."""
    body = pipe.body_buffer(length) if keep else memoryview(bytearray(min(length, PIPE_PIECE_BYTES)))
    received = last_ack = 0
    while received < length:
        got = pipe.recv_into_now(body[received:] if keep else body[:min(length - received, len(body))])
        if not got:
            raise StreamClosed("stream closed mid-frame")
        received += got
        unacked = received - last_ack
        if received == length or (unacked >= ACK_EVERY_BYTES
                                  and (unacked >= PIPE_PIECE_BYTES or not pipe.readable_within(ACK_PAUSE_S))):
            pipe.send_now(_ack(received, clock))
            last_ack = received
    if not keep:
        return b""
    return body if length >= PIPE_PIECE_BYTES else bytes(body)  # a small body as the loop's reader has it


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat view of the bytes of ``data``, copied only where they are not contiguous (a
    handler may answer with a reversed or strided view of a body read on a lane)."""
    view = memoryview(data)
    return (view if view.c_contiguous else memoryview(view.tobytes())).cast("B")


def _ack(received: int, clock: Callable[[], float]) -> bytes:
    return received.to_bytes(LENGTH_BYTES, "big") + int(clock() * 1e6).to_bytes(CLOCK_BYTES, "big")


def _parse_ack(raw: bytes | bytearray) -> tuple[int, float]:
    """(bytes received, when the receiver had them on its clock, in seconds)."""
    return int.from_bytes(raw[:LENGTH_BYTES], "big"), int.from_bytes(raw[LENGTH_BYTES:], "big") / 1e6


def _read_into(pipe: BlockingPipe, view: memoryview) -> None:
    have = 0
    while have < len(view):
        got = pipe.recv_into_now(view[have:])
        if not got:
            raise StreamClosed("stream closed before the body was acknowledged")
        have += got


async def _read_ack(reader: asyncio.StreamReader) -> tuple[int, float]:
    """(bytes received, when the receiver had them on its clock, in seconds)."""
    try:
        return _parse_ack(await reader.readexactly(LENGTH_BYTES + CLOCK_BYTES))
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed before the body was acknowledged") from None
