"""An asyncio event loop on a virtual clock, for tests of time-out logic.

``VirtualClockLoop.time()`` is a virtual now that starts at 0. When the loop has nothing
ready to run, a real loop blocks in its selector until the next timer is due; this one
polls the selector (timeout 0) and, if no I/O is ready, jumps the virtual clock to that
timer at once. So ``asyncio.sleep``, ``asyncio.timeout`` and ``call_later`` take no real
time, every timer fires in the order of its virtual deadline, and a test's outcome does
not depend on how loaded the machine is: callbacks take no virtual time however long
they really take.

Real I/O still works: sockets and ``call_soon_threadsafe`` wake the loop as usual (they
are seen by the zero-timeout poll, and with no timer scheduled the loop blocks in the
selector for real).

Threads are the catch: while a thread works the loop has nothing to do, and jumping to
the next timer would fire time-outs the thread's work should have beaten. The loop
therefore tracks the jobs it hands to ``run_in_executor`` (which ``asyncio.to_thread``
and ``getaddrinfo`` use too): while one is running, or its result is not delivered yet,
it blocks in the selector for real and the virtual clock moves with the real one,
never past the next timer. Threads it cannot see (one a test starts itself, a future
of another executor wrapped with ``asyncio.wrap_future``) need ``with
loop.real_time(): ...`` around the wait; otherwise this loop is only for code that
does not wait on threads.

Code that spins (a task that never waits, say on a time-out already passed) freezes the
virtual clock, so the time-out that would end it on a real clock never comes: after
``busy_turn_limit`` loop turns in a row with callbacks always ready the loop raises
RuntimeError instead of hanging.

Code under test must read the loop's clock (``asyncio.get_running_loop().time()``),
not ``time.monotonic()``, or its deadlines and the loop's timers disagree.

Use::

    from swarm_node.scale.vclock import run, virtual_clock

    def test_x():
        assert run(scenario()) == ...       # like asyncio.run

    @virtual_clock
    async def test_y(param):                 # an async test run on a fresh virtual loop
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import selectors
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Job:
    """One ``run_in_executor`` call: pending while the thread runs its function or the
    loop has not delivered the result yet."""

    __slots__ = ("future", "running")

    def __init__(self) -> None:
        self.running = True
        self.future: asyncio.Future | None = None

    def pending(self) -> bool:
        return self.running or self.future is None or not self.future.done()


class _VirtualSelector:
    """Wraps the loop's real selector: the loop calls ``select(timeout)`` with the time
    until its next timer, and this is where the virtual clock jumps."""

    def __init__(self, selector: selectors.BaseSelector, loop: VirtualClockLoop):
        self._selector = selector
        self._loop = loop

    def __getattr__(self, name: str) -> Any:  # register, unregister, modify, get_map, close, ...
        return getattr(self._selector, name)

    def select(self, timeout: float | None = None) -> list:
        if timeout is not None and timeout <= 0:
            self._loop._note_busy_turn()
            return self._selector.select(0)  # callbacks are ready: just poll
        self._loop._busy_turns = 0
        events = self._selector.select(0)
        if events:
            return events  # I/O or a thread-safe call is waiting: time stands still
        if self._loop._waiting_on_threads():
            start = time.monotonic()
            events = self._selector.select(timeout)  # the thread's result wakes us via the self-pipe
            elapsed = time.monotonic() - start
            self._loop._advance(elapsed if timeout is None else min(elapsed, timeout))
            return events
        if timeout is None:
            return self._selector.select(None)  # no timer at all: only real I/O can wake us
        self._loop._advance(timeout)  # nothing else can happen before the next timer
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual; see the module docstring."""

    def __init__(self, start: float = 0.0, selector: selectors.BaseSelector | None = None,
                 busy_turn_limit: int | None = 200_000):
        self._now = float(start)
        self._jobs: set[_Job] = set()
        self._real_time_holds = 0
        self._busy_turns = 0  # loop turns in a row that had callbacks ready, so time stood still
        self.busy_turn_limit = busy_turn_limit
        super().__init__(_VirtualSelector(selector or selectors.DefaultSelector(), self))

    def time(self) -> float:
        return self._now

    def _note_busy_turn(self) -> None:
        """Code that spins (a task that never waits, a time-out recomputed as already
        passed) freezes the virtual clock, so a time-out meant to end the spin never
        comes: fail after ``busy_turn_limit`` such turns rather than hang."""
        self._busy_turns += 1
        if self.busy_turn_limit is not None and self._busy_turns > self.busy_turn_limit:
            self._busy_turns = 0  # the clean-up after this error gets turns of its own
            raise RuntimeError(f"the virtual clock stood still for {self.busy_turn_limit} loop turns with "
                               f"callbacks always ready, at virtual time {self._now}: a task spins")

    def _advance(self, seconds: float) -> None:
        later = self._now + seconds
        # A step too small to change the float would leave the loop polling forever.
        self._now = later if later > self._now or seconds <= 0 else math.nextafter(self._now, math.inf)

    def _waiting_on_threads(self) -> bool:
        if self._real_time_holds:
            return True
        self._jobs = {job for job in self._jobs if job.pending()}
        return bool(self._jobs)

    @contextlib.contextmanager
    def real_time(self):
        """While inside, the virtual clock follows the real one (never jumping): for
        waits on threads the loop cannot see."""
        self._real_time_holds += 1
        try:
            yield
        finally:
            self._real_time_holds -= 1

    def run_in_executor(self, executor, func, *args):
        if asyncio.iscoroutine(func) or inspect.iscoroutinefunction(func):
            raise TypeError("coroutines cannot be used with run_in_executor()")
        job = _Job()

        def call():
            try:
                return func(*args)
            finally:
                job.running = False  # the result still has to reach the loop: see _Job.pending

        self._jobs.add(job)
        try:
            job.future = super().run_in_executor(executor, call)
        except BaseException:
            self._jobs.discard(job)
            raise
        return job.future

    async def shutdown_default_executor(self, *args, **kwargs):
        # It waits (with a time-out on 3.12+) for the executor's threads to finish.
        with self.real_time():
            await super().shutdown_default_executor(*args, **kwargs)


def run(coro: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Like ``asyncio.run`` on a fresh VirtualClockLoop: tasks left over are cancelled
    and the loop is closed afterwards."""
    with asyncio.Runner(debug=debug, loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)


def virtual_clock(test):
    """Decorator for an ``async def`` test: pytest sees a plain function with the same
    parameters (fixtures and parametrize work) that runs the test on a virtual loop."""
    if not inspect.iscoroutinefunction(test):
        raise TypeError(f"{test.__qualname__} is not an async function")

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return run(test(*args, **kwargs))

    return wrapper

