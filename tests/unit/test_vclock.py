"""The virtual-clock event loop of tests/vclock.py: timers take no real time and keep
their order, real wake-ups still work, and threads are waited for in real time."""

import asyncio
import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from vclock import VirtualClockLoop, run, virtual_clock


def test_an_hour_of_sleep_takes_no_real_time():
    async def scenario():
        await asyncio.sleep(3600)
        return asyncio.get_running_loop().time()

    start = time.monotonic()
    assert run(scenario()) == 3600
    assert time.monotonic() - start < 0.5


def test_the_loop_is_a_virtual_one_starting_at_zero():
    async def scenario():
        loop = asyncio.get_running_loop()
        return isinstance(loop, VirtualClockLoop), loop.time()

    assert run(scenario()) == (True, 0.0)


def test_a_time_out_fires_at_its_virtual_deadline():
    async def scenario():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(10)
        fired_at = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=2.5)
        return fired_at, loop.time()

    assert run(scenario()) == (5, 7.5)


def test_timers_fire_in_order_of_their_deadlines():
    async def sleeper(delay, log):
        await asyncio.sleep(delay)
        log.append((delay, asyncio.get_running_loop().time()))

    async def scenario():
        log = []
        delays = [7, 0.5, 3, 120, 0.001, 3.25, 60]
        await asyncio.gather(*(sleeper(d, log) for d in delays))
        return log

    log = run(scenario())
    assert [d for d, _ in log] == sorted([7, 0.5, 3, 120, 0.001, 3.25, 60])
    assert all(at == delay for delay, at in log)  # each woke exactly at its deadline


def test_busy_callbacks_take_no_virtual_time():
    """A loaded machine makes callbacks slow, not the virtual clock later."""
    async def scenario():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(1)
        time.sleep(0.05)  # noqa: ASYNC251 - a slow callback, on purpose
        before = loop.time()
        await asyncio.sleep(0)
        return before, loop.time()

    assert run(scenario()) == (1, 1)


def test_a_cancelled_tasks_timer_does_not_advance_time():
    async def scenario():
        loop = asyncio.get_running_loop()
        sleeper = asyncio.create_task(asyncio.sleep(100))
        await asyncio.sleep(0)  # its timer is scheduled
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        after_cancel = loop.time()
        await asyncio.sleep(1)
        return after_cancel, loop.time()

    assert run(scenario()) == (0, 1)


def test_real_io_wakes_the_loop():
    async def scenario():
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        writer = threading.Timer(0.05, theirs.send, (b"ping",))
        writer.start()
        try:
            data = await loop.sock_recv(ours, 16)
        finally:
            writer.join()
            ours.close()
            theirs.close()
        return data, loop.time()

    assert run(scenario()) == (b"ping", 0)  # no timer was due: the virtual clock stood still


def test_io_ready_while_a_timer_is_scheduled_is_taken_before_the_clock_jumps():
    async def scenario():
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        try:
            async with asyncio.timeout(1000):
                receiving = asyncio.create_task(loop.sock_recv(ours, 16))
                await asyncio.sleep(0)  # it found nothing and waits on the selector
                theirs.send(b"ready")
                data = await receiving
        finally:
            ours.close()
            theirs.close()
        return data, loop.time()

    assert run(scenario()) == (b"ready", 0)


def test_a_thread_safe_callback_wakes_the_loop():
    async def scenario():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        setter = threading.Timer(0.05, loop.call_soon_threadsafe, (done.set_result, "from a thread"))
        setter.start()
        try:
            return await done, loop.time()
        finally:
            setter.join()

    assert run(scenario()) == ("from a thread", 0)


def test_executor_work_is_waited_for_in_real_time():
    """While a thread works the loop must not jump to the next timer: that would fire the
    time-out the thread's answer beats. Meanwhile the virtual clock follows the real one,
    so a timer due during the work still fires on time (here it is what lets the thread
    finish)."""
    gate = threading.Event()

    async def ticker(log):
        await asyncio.sleep(0.05)
        log.append(("tick", asyncio.get_running_loop().time()))
        gate.set()

    async def work(log):
        async with asyncio.timeout(30):
            await asyncio.to_thread(gate.wait, 5)
        log.append(("work", asyncio.get_running_loop().time()))

    async def scenario():
        log = []
        await asyncio.gather(work(log), ticker(log))
        return log

    try:
        (first, tick_at), (second, work_at) = run(scenario())
    finally:
        gate.set()
    assert (first, second) == ("tick", "work")
    assert tick_at == pytest.approx(0.05, abs=1e-6)
    assert tick_at <= work_at < 30


def test_a_threads_result_still_on_its_way_to_the_loop_is_waited_for():
    """The function has returned but its result has not reached the loop yet (here the
    executor holds it back for 0.1 s): the loop must still not jump to the time-out."""
    gate = threading.Event()

    class SlowDelivery(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            def deliver_late():
                result = fn(*args, **kwargs)
                gate.wait(5)
                return result
            return super().submit(deliver_late)

    async def scenario():
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(30):
            return await loop.run_in_executor(executor, lambda: 42), loop.time()

    opener = threading.Timer(0.1, gate.set)
    with SlowDelivery(max_workers=1) as executor:
        opener.start()
        answer, at = run(scenario())
    opener.join()
    assert answer == 42 and at < 30  # no time-out (it would have raised), no jump


def test_a_time_out_still_fires_on_slow_executor_work():
    async def scenario():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await loop.run_in_executor(None, time.sleep, 0.3)
        return loop.time()

    assert run(scenario()) == pytest.approx(0.05, abs=1e-6)


def test_a_thread_left_running_by_a_time_out_still_holds_the_clock():
    """The time-out gave up on the thread's future, but the thread runs on and answers
    the loop by itself: the loop must wait for it in real time, not jump."""
    gate = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def work():
            gate.wait(5)
            time.sleep(0.05)  # still working when the loop next looks
            loop.call_soon_threadsafe(answer.set_result, "late answer")

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await loop.run_in_executor(None, work)
        gate.set()
        async with asyncio.timeout(30):
            return await answer, loop.time()

    try:
        answer, at = run(scenario())
    finally:
        gate.set()
    assert answer == "late answer" and at < 30


def test_an_unseen_thread_needs_real_time():
    """A thread the loop does not know of: without ``real_time()`` the clock jumps to
    the time-out (the documented limit), inside it the thread's answer arrives first."""
    async def wait_for_thread(hold: bool):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        go = threading.Event()

        def thread():
            go.wait(5)
            loop.call_soon_threadsafe(answer.set_result, "answer")

        worker = threading.Thread(target=thread, daemon=True)
        worker.start()
        try:
            if hold:
                loop.call_later(0, go.set)  # the thread answers as soon as the loop waits
                with loop.real_time():
                    async with asyncio.timeout(30):
                        return await answer
            async with asyncio.timeout(30):
                return await asyncio.shield(answer)
        except TimeoutError:
            return f"timed out at {loop.time()}"
        finally:
            go.set()
            worker.join()

    assert run(wait_for_thread(hold=True)) == "answer"
    assert run(wait_for_thread(hold=False)) == "timed out at 30.0"


def test_a_spinning_task_fails_instead_of_hanging():
    """A time-out recomputed as already passed makes a task spin; on a real clock the
    outer time-out would end it, on the virtual one time stands still: the loop says so."""
    async def spin():
        never = asyncio.Event()
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(-0.1):
                        await never.wait()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="virtual clock stood still"):
        run(spin())
    assert time.monotonic() - start < 30


def test_run_cancels_leftover_tasks_and_closes_the_loop():
    cleaned = []

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    async def scenario():
        asyncio.create_task(forever())
        await asyncio.sleep(1)
        return asyncio.get_running_loop()

    loop = run(scenario())
    assert cleaned == [True]
    assert loop.is_closed()


@pytest.mark.parametrize("delay", [0.1, 86400 * 3])
@virtual_clock
async def test_the_decorator_runs_an_async_test_on_the_virtual_clock(delay):
    await asyncio.sleep(delay)
    assert asyncio.get_running_loop().time() == delay
