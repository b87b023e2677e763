"""The test bed's latency stage: a userspace wire between pairs of TAP devices.

``tc netem`` is missing on these machines, so a link with latency is two TAP devices,
one in the host's namespace and one in the namespace of the bridge, and this program
moves every Ethernet frame from one to the other after a fixed delay per direction.
Frames keep their order (one FIFO per direction, one delay each). Rate limits stay in
the kernel: ``tc tbf`` on the TAP devices shapes what reaches this program.

    python delay.py NS_A:DEV_A:NS_B:DEV_B:A_TO_B_MS:B_TO_A_MS [...]

prints ``ready`` once every TAP is attached (until then the devices have no carrier),
and exits when its parent dies or on SIGTERM."""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import selectors
import signal
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import entered

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
PR_SET_PDEATHSIG = 1
MAX_FRAME_BYTES = 65_536
MAX_QUEUED_FRAMES = 20_000  # per direction: beyond this a burst is tail-dropped, like a full queue
READ_BURST = 64  # frames read from one device before others get a turn


def open_tap(namespace: str, device: str) -> int:
    with entered(namespace):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TAP | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


class Direction:
    """Frames read from ``source`` wait ``delay_s`` and are written to ``sink``."""

    def __init__(self, source: int, sink: int, delay_s: float):
        self.source, self.sink, self.delay_s = source, sink, delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()

    def read(self, now: float) -> None:
        for _ in range(READ_BURST):
            try:
                frame = os.read(self.source, MAX_FRAME_BYTES)
            except BlockingIOError:
                return
            if len(self.queue) < MAX_QUEUED_FRAMES:
                self.queue.append((now + self.delay_s, frame))

    def flush(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                os.write(self.sink, frame)
            except OSError:  # the far end is gone or full: the frame is lost, as on a wire
                pass

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def parse_link(text: str) -> tuple[str, str, str, str, float, float]:
    ns_a, dev_a, ns_b, dev_b, a_to_b_ms, b_to_a_ms = text.split(":")
    return ns_a, dev_a, ns_b, dev_b, float(a_to_b_ms) / 1e3, float(b_to_a_ms) / 1e3


def main(argv: list[str]) -> int:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # never outlive the test bed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    directions: list[Direction] = []
    for text in argv:
        ns_a, dev_a, ns_b, dev_b, a_to_b_s, b_to_a_s = parse_link(text)
        fd_a, fd_b = open_tap(ns_a, dev_a), open_tap(ns_b, dev_b)
        for direction in (Direction(fd_a, fd_b, a_to_b_s), Direction(fd_b, fd_a, b_to_a_s)):
            directions.append(direction)
            selector.register(direction.source, selectors.EVENT_READ, direction)
    print("ready", flush=True)
    while True:
        dues = [d for d in (direction.next_due() for direction in directions) if d is not None]
        timeout = max(0.0, min(dues) - time.monotonic()) if dues else None
        for key, _ in selector.select(timeout):
            key.data.read(time.monotonic())
        now = time.monotonic()
        for direction in directions:
            direction.flush(now)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
