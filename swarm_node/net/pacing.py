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

The receiver acknowledges at least every ``ACK_EVERY_BYTES`` and once at the end, so
the last acknowledgement equals the length and whatever follows on that direction is
the next frame (an empty body has no acknowledgement). The sender checks every acknowledgement (rising, never past what was
sent): a receiver that lies gets a ProtocolError, one that never acknowledges runs into
the caller's deadline.

The delay that counts is one way: when the receiver read a byte (its clock, sent with
the acknowledgement) less when we wrote it (ours), over the smallest such difference
seen; the clocks' offset cancels. A round trip would also count the queue on the way
back, where the partner's own payload is moving at the same time: a window measured by
round trips was cut by the other direction's traffic and the fetch ran at 60 % of the
link. The window starts at ``initial_bytes`` and grows by half each round trip while the
queueing delay stays under half the target; after that it grows by up to an eighth a round trip below the target and
shrinks (at most once a round trip, to no less than half) above it. In a simulation of
links from 2 to 1000 Mbit/s and 2 to 300 ms (tests/unit/test_pacing.py) a transfer keeps
the link busy (within 3 %, 10 % at 300 ms) and what waits behind it waits 0.1-0.15 s. On loopback the sender does not wait for
acknowledgements at all: there is no uplink to share, and a busy machine's scheduling
delays would otherwise read as queueing."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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
            if now - self._last_cut_s >= rtt_s:  # one cut a round trip: the samples after it still show the old queue
                self._last_cut_s = now
                self.window_bytes = int(self.window_bytes * max(0.5, c.target_s / queueing_s))
        elif self.slow_start and queueing_s < c.target_s / 2:
            self.window_bytes += acked_bytes // 2
        else:
            self.slow_start = False
            self.window_bytes += int(acked_bytes * GROWTH_PER_RTT * (1 - queueing_s / c.target_s))
        self.window_bytes = min(c.max_bytes, max(c.min_bytes, self.window_bytes))


async def send_paced(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes,
                     pacer: Pacer | None) -> None:
    """Write ``data`` as a paced body and read its acknowledgements to the last one.
    ``pacer`` None: write it all at once (loopback), still reading the acknowledgements."""
    clock = pacer.clock if pacer is not None else time.monotonic
    writer.write(len(data).to_bytes(LENGTH_BYTES, "big"))
    view = memoryview(data)
    sent = acked = 0
    in_flight: deque[tuple[int, float]] = deque()  # (end offset of a chunk, when it was written)
    while acked < len(data):
        window = pacer.window_bytes if pacer is not None else len(data)
        chunk = pacer.config.chunk_bytes if pacer is not None else len(data)
        while sent < len(data) and sent - acked < window:
            n = min(chunk, len(data) - sent, max(1, window - (sent - acked)))
            writer.write(view[sent:sent + n])
            sent += n
            in_flight.append((sent, clock()))
        await writer.drain()
        ack, read_at_s = await _read_ack(reader)
        if not acked < ack <= sent:
            raise ProtocolError(f"acknowledged {ack} bytes after {acked}, of {sent} sent")
        written_at = None
        while in_flight and in_flight[0][0] <= ack:
            written_at = in_flight.popleft()[1]
        if pacer is not None and written_at is not None:
            pacer.on_ack(ack - acked, read_at_s - written_at, clock() - written_at)
        acked = ack


async def read_paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int,
                     keep: bool = True, clock: Callable[[], float] = time.monotonic) -> bytes:
    """Read a paced body of ``length`` bytes (its length prefix already read and checked
    against the cap), acknowledging as it comes; ``keep`` False reads it and throws it
    away (a busy answer to a caller that is sending anyway)."""
    parts: list[bytes] = []
    received = last_ack = 0
    while received < length:
        part = await reader.read(min(READ_CHUNK_BYTES, length - received))
        if not part:
            raise StreamClosed("stream closed mid-frame")
        received += len(part)
        if keep:
            parts.append(part)
        if received - last_ack >= ACK_EVERY_BYTES or received == length:
            writer.write(received.to_bytes(LENGTH_BYTES, "big") + int(clock() * 1e6).to_bytes(CLOCK_BYTES, "big"))
            last_ack = received
    await writer.drain()
    return b"".join(parts)


async def _read_ack(reader: asyncio.StreamReader) -> tuple[int, float]:
    """(bytes received, when the receiver had them on its clock, in seconds)."""
    try:
        raw = await reader.readexactly(LENGTH_BYTES + CLOCK_BYTES)
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed before the body was acknowledged") from None
    return int.from_bytes(raw[:LENGTH_BYTES], "big"), int.from_bytes(raw[LENGTH_BYTES:], "big") / 1e6
