"""When a body on a served stream counts as stalled: how a server tells a caller on a
full, slow link from one that holds a slot without sending (or without reading).

A body is a request the server reads (from its length prefix on), or a paced answer
whose acknowledgements it waits for (net/pacing.py). The bodies one caller has open in
one direction share its link, and are judged together, as one flow: on a full link
each stream gets the link's rate divided by the streams sharing it, and a TCP flow that
lost its packets again and again waits out its retransmission back-off (1 + 2 + 4 + 8 s)
while the caller's other streams move. So a body stalls when

- its caller moved no byte, on any of its bodies, for ``stall_s``;
- or a body that has not begun (no length prefix yet) is older than ``first_s`` and the
  caller moved nothing else meanwhile either (a silent stream alone is cut then; one
  queued behind the caller's other bytes waits with them);
- or the caller's bodies together fall more than ``stall_s`` behind ``min_bytes_per_s``
  for each body open: a floor far below one stream's share of a full home uplink, so
  that every slot a caller holds costs it bandwidth, whatever it does with the others.

Each is the caller's doing: a ``Stalled`` error, which servers count as a fault. A body
still moving after ``max_s`` is cut too, but with a plain TimeoutError: no honest caller
waits that long, yet one that gave up may still have bytes on their way (a closed TCP
socket sends what it holds), and they look like a slow caller's.

No deadline at an expected rate can tell a full link from a stall: the receiver sees
neither the link's rate nor how many streams share it. A receiver judges a download it
makes by the same rule (``Flow``; state/sync.py judges a donor's chunks so)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from swarm_node.errors import StreamClosed
from swarm_node.net.pacing import READ_CHUNK_BYTES, BlockingPipe, Meter

CHECK_EVERY_S = 1.0  # how often an open body's progress is looked at
DISCARD_CHUNK_BYTES = 64 << 10


class Stalled(TimeoutError):
    """A body's caller paused, or fell behind the floor rate."""


@dataclass(frozen=True)
class StallRule:
    stall_s: float
    min_bytes_per_s: float
    max_s: float
    first_s: float = float("inf")


class Flow:
    """One caller's open bodies in one direction, together (or one download, judged by
    its receiver): what they owe (the floor for each, from its start) less what they
    moved, capped on both sides at ``stall_s`` of the floor for each; and when any of
    them last moved."""

    __slots__ = ("bodies", "owed_per_s", "allowance", "credit", "at", "moved_at")

    def __init__(self, now: float):
        self.bodies, self.owed_per_s, self.allowance, self.credit = 0, 0.0, 0.0, 0.0
        self.at = self.moved_at = now

    def settle(self, now: float) -> None:
        self.credit -= self.owed_per_s * (now - self.at)
        self.at = now

    def took(self, count: int, now: float) -> None:
        if count:
            self.credit = min(self.credit + count, self.allowance)
            self.moved_at = now

    def join(self, rule: StallRule, sign: int, now: float) -> None:
        self.settle(now)
        self.bodies += sign
        self.owed_per_s += sign * rule.min_bytes_per_s
        self.allowance += sign * rule.min_bytes_per_s * rule.stall_s
        self.credit = min(self.credit, self.allowance)

    def stalled(self, rule: StallRule, now: float, since: float) -> bool:
        """Whether it stalls at ``now`` by ``rule``: nothing moved for ``stall_s`` (counted
        from ``since`` at the earliest), or more than ``stall_s`` behind the floor."""
        self.settle(now)
        return now - max(self.moved_at, since) >= rule.stall_s or self.credit < -self.allowance

    def left_s(self, rule: StallRule, now: float, since: float) -> float:
        """How long from ``now`` until it stalls if nothing more moves."""
        self.settle(now)
        quiet_s = max(self.moved_at, since) + rule.stall_s - now
        behind_s = (self.credit + self.allowance) / self.owed_per_s if self.owed_per_s > 0 else quiet_s
        return max(0.0, min(quiet_s, behind_s))


class Flows:
    """Every caller's open bodies, by (caller, direction); an entry lives while one of
    its bodies is open (bounded by the stream caps)."""

    def __init__(self):
        self._flows: dict[Hashable, Flow] = {}

    def __len__(self) -> int:
        return len(self._flows)

    @asynccontextmanager
    async def watch(self, key: Hashable, rule: StallRule, moved: Callable[[], int],
                    begun: Callable[[], bool] = lambda: True) -> AsyncIterator[None]:
        """Cuts the block once its body stalls by ``rule`` (raising ``Stalled``) or runs
        past ``rule.max_s`` (TimeoutError, as ``asyncio.timeout`` raises). ``moved()``:
        the bytes it has moved so far (it may be counted on another thread: it is sampled
        here, on the event loop); ``begun()``: whether its first bytes came."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        flow = self._flows.get(key)
        if flow is None:
            flow = self._flows[key] = Flow(started)
        flow.join(rule, +1, started)
        last = moved()
        check, stalled = None, False

        def next_look(now: float) -> float:
            when = min(now + CHECK_EVERY_S, started + rule.max_s)
            return min(when, started + rule.first_s) if started + rule.first_s > now and not begun() else when

        try:
            async with asyncio.timeout(None) as scope:
                def look() -> None:
                    nonlocal last, check, stalled
                    now = loop.time()
                    count = moved()
                    flow.settle(now)
                    flow.took(count - last, now)
                    last = count
                    quiet_s = now - max(flow.moved_at, started)  # each body has its own start
                    stalled = flow.stalled(rule, now, started) or (quiet_s >= rule.first_s and not begun())
                    if stalled or now >= started + rule.max_s:
                        check = None
                        scope.reschedule(now)  # expires at once: TimeoutError in the block
                    else:
                        check = loop.call_at(next_look(now), look)

                check = loop.call_at(next_look(started), look)
                try:
                    yield
                finally:
                    if check is not None:
                        check.cancel()
        except TimeoutError:
            if stalled and scope.expired():
                raise Stalled(f"{last} bytes in {loop.time() - started:.0f} s") from None
            raise
        finally:
            flow.join(rule, -1, loop.time())
            if not flow.bodies:
                del self._flows[key]


def moved(reader: asyncio.StreamReader | None, meter: Meter) -> Callable[[], int]:
    """How many bytes a body has moved since now: a pipe counts what it reads for itself
    (on its thread); the event loop's reads count into ``meter``."""
    if isinstance(reader, BlockingPipe):
        base = reader.received
        return lambda: reader.received - base
    return lambda: meter.bytes


async def read_counted(reader: asyncio.StreamReader, length: int, meter: Meter) -> bytes:
    """A frame's body of ``length`` bytes, counted into ``meter`` as it comes (read in
    pieces; a pipe reads it whole on its thread and counts for itself)."""
    try:
        if isinstance(reader, BlockingPipe):
            return await reader.readexactly(length)
        parts = []
        got = 0
        while got < length:
            part = await reader.read(min(length - got, READ_CHUNK_BYTES))
            if not part:
                raise asyncio.IncompleteReadError(b"", length)
            parts.append(part)
            got += len(part)
            meter.bytes += len(part)
        return b"".join(parts)
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed mid-frame") from None


async def discard_counted(reader: asyncio.StreamReader, length: int, meter: Meter) -> bytes:
    """Read a frame's body and throw it away, holding at most a chunk of it in memory."""
    try:
        while length:
            part = await reader.readexactly(min(length, DISCARD_CHUNK_BYTES))
            length -= len(part)
            meter.bytes += len(part)
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed mid-frame") from None
    return b""
