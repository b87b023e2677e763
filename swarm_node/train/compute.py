"""The threads a node does torch work on: the compute thread, and beside it the wire
thread.

Every forward, backward, step and checkpoint copy of a node runs on the compute thread,
so the event loop never blocks and the model and optimizer state are never touched by
two threads at once. What crosses a stage boundary is encoded and decoded on the wire
thread (``WireThread``), beside the next micro-batch's compute: it reads tensors the
compute thread has finished with (on CUDA, host copies it waits for:
train/host_copy.py) and makes new ones, and touches no model state.

An out-of-memory failure on the compute thread, wherever it happens (a peer's request,
our own producer), is fatal: it becomes one line naming the model size, the device
memory and what to try, and the node is told to stop.

Both threads run at a lower scheduling priority than the rest of the node (nice +10, on
Linux a thread's own): where the CPU is short, the event loop, the libp2p daemon and
the DHT, which keep the node's deadlines (proposals, heartbeats, answers), go first,
and the user's other programs too, as volunteer-computing clients do. With the CPU to
itself it runs at full speed; an outer round that no longer pauses compute would
otherwise starve the control traffic of a CPU-bound node.

A node may also be told to compute only a share of the time (``--compute-share``), as
volunteer-computing clients throttle: after each piece of work the thread rests in
proportion to it, before the result is handed on. Resting before the hand-off is what
slows the whole node (its messages, its routing share, its stated throughput) and not
just this thread, whose work is often the smaller part of a small model's micro-batch."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import torch

from swarm_node.errors import PeerRefused, SwarmError
from swarm_node.node_config import check_compute_share

log = logging.getLogger(__name__)
Explain = Callable[[BaseException], SwarmError | None]
COMPUTE_NICE = 10


def _start_torch_thread(threads: int | None) -> None:
    """In the compute thread, before its first task: its priority, then torch's thread
    count (OpenMP keeps one per OS thread, so the main thread's setting would not reach
    it; its workers, created from here, inherit the priority)."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + COMPUTE_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the node's priority
        pass
    if threads:
        torch.set_num_threads(threads)


class ComputeThread:
    def __init__(self, threads: int | None = None,
                 on_fatal: Callable[[SwarmError], None] = lambda error: None, share: float = 1.0):
        check_compute_share(share)
        self._rest_per_busy = 1 / share - 1  # seconds of rest per second of work
        if share < 1:
            log.info("computing at most %.0f%% of the time, resting the remainder (compute share %g)",
                     100 * share, share)
        self._closing = threading.Event()  # ends a rest at once: shutdown never waits for one
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                            initializer=_start_torch_thread, initargs=(threads,))
        self.on_fatal = on_fatal
        self.explain: Explain = lambda exc: None  # set once the node knows its stage and device
        self.closed = False

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self._submit(partial(self._run, partial(fn, *args, **kwargs)))

    async def unthrottled(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One-off start-up work (loading the data, building the model) without the rest a
        compute share asks for: the share caps the load training puts on a volunteer's
        machine, and at a quarter share a rest would only make joining take four times
        as long (the model built in 11 s instead of 3, the rest of the swarm waiting)."""
        return await self._submit(partial(fn, *args, **kwargs))

    async def _submit(self, job: Callable[[], Any]) -> Any:
        if self.closed:  # a stream handler the daemon still runs while we shut down
            raise PeerRefused("this node is shutting down")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, job)
        except Exception as exc:
            error = self.explain(exc)
            if error is None:
                raise
            self.on_fatal(error)
            raise error from exc

    def _run(self, job: Callable[[], Any]) -> Any:
        """In the compute thread: the job, then its rest when the node computes only a share
        of the time."""
        if not self._rest_per_busy:
            return job()
        started = time.perf_counter()
        try:
            return job()
        finally:
            self.rest((time.perf_counter() - started) * self._rest_per_busy)

    def rest(self, seconds: float) -> None:
        self._closing.wait(seconds)

    def close(self) -> None:
        self.closed = True
        self._closing.set()
        self._executor.shutdown(wait=True, cancel_futures=True)


class FairTurns:
    """Peers' requests take the compute thread in turn, one caller after the other, not
    in the order they came: in first-come order each caller's share of a busy stage is
    its share of the queue, so a previous-stage peer keeping 8 micro-batches in flight
    got four times the service of one keeping 2 (its window is sized from its own times,
    routing/window.py). (The stage-0 drift once blamed on this was traced to 35 s
    reservations held for stopped joiners: gossip/pairing.py rule 5.) The pipeline
    takes a turn for each piece of a peer's micro-batch it computes; our own work
    (stage 0's micro-batches, outer rounds) goes straight to the thread, as before.

    ``out`` turns are out at once (two: one computing, the next already queued on the
    thread, so it never idles between them); a caller that comes back while others wait
    goes behind them; a waiter that is cancelled leaves its place."""

    def __init__(self, out: int = 2):
        self._max_out = out
        self._out = 0
        self._waiting: dict[str, deque[asyncio.Future]] = {}

    @asynccontextmanager
    async def turn(self, caller: str):
        if self._out >= self._max_out or self._waiting:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(caller, deque()).append(waiter)
            try:
                await waiter  # _next counted us out when it woke us
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken and cancelled at once: pass it on
                    self._out -= 1
                    self._next()
                raise
        else:
            self._out += 1
        try:
            yield
        finally:
            self._out -= 1
            self._next()

    def _next(self) -> None:
        """Wakes the first callers in line while turns are free (each then goes to the back)."""
        while self._out < self._max_out and self._waiting:
            caller, queue = next(iter(self._waiting.items()))
            del self._waiting[caller]
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    if queue:
                        self._waiting[caller] = queue
                    self._out += 1
                    waiter.set_result(None)
                    break


class WireThread:
    """Encoding and decoding for the data path, off the compute thread: on a 2-core
    machine the copies and casts of a micro-batch's frames took the compute thread's time
    in between forwards; here they overlap them. One thread (frames of one micro-batch
    stay in order) with one torch thread: the work is memory-bound."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wire",
                                            initializer=_start_torch_thread, initargs=(1,))
        self.closed = False

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise PeerRefused("this node is shutting down")
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
