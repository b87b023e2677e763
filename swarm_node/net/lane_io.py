"""The byte pipe of a direct lane: a TLS socket whose reads and writes run on a thread of
their own, behind the reader and writer calls the protocols already make.

Why a thread: asyncio's TLS (uvloop's too) runs OpenSSL through memory buffers on the
event loop, record by record: measured here at a quarter of plain TCP, below what p2pd
carries. A blocking ``ssl.SSLSocket`` hands whole megabytes to OpenSSL and to the
kernel with the GIL released, beside the event loop and the compute thread. One thread
per lane does everything on it, one call after the other, so OpenSSL never sees two
threads on one connection.

A lane between two processes of one machine (loopback) may be plain TCP: its bytes never
reach a wire, and encrypting them cost 2.2 CPU-seconds a GB here against 0.6 for the
copy alone. The server tells the two apart by the first byte (a TLS ClientHello starts
with 0x16) and takes plain TCP only from a loopback address.

``LaneIO`` is both the reader and the writer of a lane (``readexactly``, ``read``,
``write``, ``drain``, ``close``, ``is_closing``, ``get_extra_info``), so the stream
exchanges of net/transport.py and net/pacing.py run on it unchanged. Its reads are
buffered (a burst of acknowledgements costs one trip to the thread), and a long write
picks up what the other side sent between slices, so neither side ever blocks writing
to a peer that is itself blocked writing."""

from __future__ import annotations

import asyncio
import mmap
import select
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor

from swarm_node.net.pacing import BlockingPipe, byte_view

RECV_BYTES = 256 << 10
BIG_RECV_BYTES = 4 << 20  # one receive into a big body's buffer
# A body this big is read into memory of its own (BodyBuffers), and handed on as a view of it.
BIG_READ_BYTES = 1 << 20
SEND_SLICE_BYTES = 4 << 20  # between slices, read what the other side sent (acknowledgements)
SOCKET_TIMEOUT_S = 600.0  # a backstop: every caller has its own deadline and closes the lane on it


class LaneIO(BlockingPipe):
    def __init__(self, sock: socket.socket, executor: ThreadPoolExecutor):
        self._sock = sock
        self._executor = executor
        self._buffer = bytearray()
        self._pending: list[bytes | memoryview] = []
        self._closed = False
        self._peername = sock.getpeername()
        sock.settimeout(SOCKET_TIMEOUT_S)

    # -- the reader side ------------------------------------------------------------
    # A read that goes to the socket first sends what was written before it: a paced
    # body's receiver writes its acknowledgements and reads on, draining only at the end
    # (asyncio's writer sends at once), and a sender waits for them.
    async def readexactly(self, n: int) -> bytes:
        if len(self._buffer) >= n:
            return self._take(n)
        return await self._in_thread(self._read_exactly, self._flush(), n)

    async def read(self, n: int) -> bytes:
        if self._buffer:
            return self._take(min(n, len(self._buffer)))
        return await self._in_thread(self._read_some, self._flush(), min(n, RECV_BYTES))

    # -- the writer side ------------------------------------------------------------
    def write(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise ConnectionResetError("the lane is closed")
        self._pending.append(data)

    async def drain(self) -> None:
        pending = self._flush()
        if pending:
            await self._in_thread(self._send, pending)

    def _flush(self) -> list[bytes | memoryview]:
        pending, self._pending = self._pending, []
        return pending

    def is_closing(self) -> bool:
        return self._closed

    def get_extra_info(self, name: str, default=None):
        return self._peername if name == "peername" else default

    def close(self) -> None:
        """From the loop, at any time: a thread blocked on the socket wakes with an error."""
        if self._closed:
            return
        self._closed = True
        try:
            # not SSLSocket's: no close_notify to wait on
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self._executor.submit(self._sock.close)
        self._executor.shutdown(wait=False)

    # -- a paced body, whole on the lane's thread (net/pacing.py) ---------------------
    async def run(self, fn, *args):
        return await self._in_thread(self._run, self._flush(), fn, args)

    def _run(self, pending: list[bytes | memoryview], fn, args: tuple):
        self._send(pending)
        return fn(self, *args)

    def send_now(self, data: bytes | memoryview) -> None:
        self._send([data])

    def recv_into_now(self, view: memoryview) -> int:
        if self._buffer:
            n = min(len(view), len(self._buffer))
            view[:n] = self._buffer[:n]
            del self._buffer[:n]
            return n
        got = self._sock.recv_into(view, min(len(view), BIG_RECV_BYTES))
        self.received += got
        return got

    def readable_within(self, timeout_s: float) -> bool:
        if self._buffer or (isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()):
            return True
        return bool(select.select([self._sock], [], [], timeout_s)[0])

    def buffered(self) -> int:
        self._pull_waiting()
        return len(self._buffer)

    def body_buffer(self, length: int) -> memoryview:
        return memoryview(bytearray(length)) if length < BIG_READ_BYTES else BODY_BUFFERS.take(length)

    # -- on the lane's thread ---------------------------------------------------------
    async def _in_thread(self, fn, *args):
        if self._closed:
            raise ConnectionResetError("the lane is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except BaseException:
            self.close()  # cancelled by a deadline or failed: the lane's state is unknown
            raise

    def _take(self, n: int) -> bytes:
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def _read_some(self, pending: list[bytes | memoryview], n: int) -> bytes:
        """Up to ``n`` bytes: waits for the first, then takes whatever else has arrived,
        reading ahead into the buffer (up to RECV_BYTES) whatever ``n`` leaves."""
        self._send(pending)
        self._fill(1)
        return self._take(min(n, len(self._buffer)))  # b"" when the other side has closed

    def _read_exactly(self, pending: list[bytes | memoryview], n: int) -> bytes | memoryview:
        self._send(pending)
        if n < BIG_READ_BYTES:
            if not self._fill(n):
                raise asyncio.IncompleteReadError(self._take(len(self._buffer)), n)
            return self._take(n)
        view = self.body_buffer(n)
        have = 0
        while have < n:
            got = self.recv_into_now(view[have:])
            if not got:
                raise asyncio.IncompleteReadError(bytes(view[:have]), n)
            have += got
        return view  # a big body stays in its buffer: no second copy

    def _fill(self, n: int) -> bool:
        """Reads until the buffer holds ``n`` bytes, and with them whatever else has come
        (up to RECV_BYTES); False when the other side closed first. Why read ahead: a
        request's head is three small reads before its body (name length, name, body
        length), and each that comes to this thread is a trip there and back, measured at
        0.1-4 ms on 2 busy cores while the sender, its socket buffers full, waits; read
        ahead, the head is one trip and the body starts from the buffer. (A TLS socket
        hands out one record, 16 KiB, a call: the wait is for one, the rest is what has
        arrived since.)"""
        while len(self._buffer) < n:
            part = self._sock.recv(max(RECV_BYTES, n - len(self._buffer)))
            if not part:
                return False
            self.received += len(part)
            self._buffer += part
            self._pull_waiting(RECV_BYTES - len(self._buffer))
        return True

    def _send(self, pending: list[bytes | memoryview]) -> None:
        for data in pending:
            view = byte_view(data)
            for start in range(0, len(view), SEND_SLICE_BYTES):
                self._sock.sendall(view[start:start + SEND_SLICE_BYTES])
                if len(view) > SEND_SLICE_BYTES:
                    self._pull_waiting()

    def _pull_waiting(self, limit: int = 1 << 62) -> None:
        """What the other side has sent so far (up to about ``limit``), without waiting."""
        self._sock.setblocking(False)
        try:
            while limit > 0:
                part = self._sock.recv(min(limit, RECV_BYTES))
                if not part:
                    return
                self.received += len(part)
                self._buffer += part
                limit -= len(part)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            pass
        finally:
            self._sock.settimeout(SOCKET_TIMEOUT_S)


class BodyBuffers:
    """Memory for big bodies, used again once whoever read a body has let go of it.

    A fresh buffer costs its page faults: a 40 MB body faulted in 4 KiB pages took 40 ms
    here, as long as the transfer itself, in huge pages 9-13 ms; a stage receives a body
    of the same size micro-batch after micro-batch. A buffer is free when nothing views
    it any more (an mmap with views refuses to resize: the test costs one system call).
    At most ``keep`` buffers of at most ``max_kept_bytes`` each are kept, shared by the
    lanes' threads (a big model's outer payload, a gigabyte, is read into memory of its
    own and freed with its last view: its transfer dwarfs its page faults)."""

    def __init__(self, keep: int = 4, max_kept_bytes: int = 64 << 20):
        self._keep, self.max_kept_bytes = keep, max_kept_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes, in a buffer nothing else views."""
        with self._lock:
            for buffer in self._buffers:
                if n <= len(buffer) <= 2 * n and _unviewed(buffer):
                    self.reused += 1
                    return memoryview(buffer)[:n]
            buffer = _huge_buffer(n)
            view = memoryview(buffer)
            if n > self.max_kept_bytes:
                return view
            self._buffers.append(buffer)
            if len(self._buffers) > self._keep:  # the oldest goes; its memory with its last view
                self._buffers.pop(0)
            return view


def _unviewed(buffer: mmap.mmap) -> bool:
    try:
        buffer.resize(len(buffer))
    except BufferError:
        return False
    return True


BODY_BUFFERS = BodyBuffers()  # one per process: every lane's bodies


def _huge_buffer(n: int) -> mmap.mmap:
    """``n`` bytes of anonymous memory, in transparent huge pages where the kernel allows
    them (madvise mode): fewer and cheaper page faults."""
    buffer = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buffer


def lane_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="lane")


TLS_RECORD_START = 0x16  # the first byte of a TLS handshake record (a ClientHello)


async def dial(host: str, port: int, context: ssl.SSLContext | None, timeout_s: float) -> tuple[LaneIO,
                                                                                                bytes]:
    """A lane to ``host``:``port``, in TLS with ``context`` (None: plain TCP, for
    loopback only): (its pipe, the DER certificate the far end showed, or b"")."""
    executor = lane_executor()

    def connect() -> socket.socket:
        raw = socket.create_connection((host, port), timeout=timeout_s)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return context.wrap_socket(raw) if context is not None else raw
        except BaseException:
            raw.close()
            raise

    try:
        sock = await asyncio.get_running_loop().run_in_executor(executor, connect)
    except BaseException:
        executor.shutdown(wait=False)
        raise
    der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
    return LaneIO(sock, executor), der or b""


async def handshake(raw: socket.socket, context: ssl.SSLContext, timeout_s: float, plain_ok: bool) -> LaneIO:
    """The server side of a new connection: TLS when it starts with a ClientHello, plain
    TCP when ``plain_ok`` (a caller on loopback); anything else raises and closes it."""
    executor = lane_executor()

    def server_side() -> socket.socket:
        raw.setblocking(True)
        raw.settimeout(timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = raw.recv(1, socket.MSG_PEEK)
        if first and first[0] == TLS_RECORD_START:
            return context.wrap_socket(raw, server_side=True)
        if first and plain_ok:
            return raw
        raise ConnectionRefusedError("a lane from another host must use TLS")

    try:
        sock = await asyncio.get_running_loop().run_in_executor(executor, server_side)
    except BaseException:
        raw.close()
        executor.shutdown(wait=False)
        raise
    return LaneIO(sock, executor)
