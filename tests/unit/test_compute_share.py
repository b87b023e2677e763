"""A node told to compute only a share of the time (``--compute-share``) rests after each
piece of work in proportion to it, before the result is handed on, and never makes a
shutdown wait for a rest."""

import asyncio
import threading
import time

import pytest

from swarm_node.cli import main as cli
from swarm_node.local.swarm import LocalConfig
from swarm_node.train.compute import ComputeThread


class RecordedRests(ComputeThread):
    """The real thread, with its rests written down instead of waited for."""

    def __init__(self, share: float):
        super().__init__(threads=1, share=share)
        self.rests: list[float] = []

    def rest(self, seconds: float) -> None:
        self.rests.append(seconds)


def busy_for(seconds: float) -> float:
    """Work the compute thread is busy with; returns how long it took, as it measured."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass
    return time.perf_counter() - started


@pytest.mark.parametrize("share, rest_per_busy", [(0.25, 3.0), (0.5, 1.0)])
def test_each_piece_of_work_is_followed_by_a_proportional_rest(share, rest_per_busy):
    async def scenario():
        compute = RecordedRests(share)
        timed = []
        try:
            for _ in range(3):
                started = time.perf_counter()
                inside = await compute(busy_for, 0.02)
                timed.append((inside, time.perf_counter() - started))
            return timed, compute.rests
        finally:
            compute.close()

    timed, rests = asyncio.run(scenario())
    assert len(rests) == 3
    for (inside, outside), rest in zip(timed, rests):
        # the thread times the job between the job's own clock and the caller's
        assert rest_per_busy * inside <= rest <= rest_per_busy * outside


def test_a_failed_job_rests_too_and_its_error_still_reaches_the_caller():
    async def scenario():
        compute = RecordedRests(0.5)
        try:
            with pytest.raises(ZeroDivisionError):
                await compute(lambda: 1 / 0)
            return compute.rests
        finally:
            compute.close()

    assert len(asyncio.run(scenario())) == 1


def test_start_up_work_does_not_rest_and_training_after_it_does():
    async def scenario():
        compute = RecordedRests(0.25)
        try:
            built = await compute.unthrottled(busy_for, 0.01)
            after_setup = list(compute.rests)
            await compute(busy_for, 0.01)
            return built, after_setup, compute.rests
        finally:
            compute.close()

    built, after_setup, rests = asyncio.run(scenario())
    assert built >= 0.01 and after_setup == [] and len(rests) == 1 and rests[0] >= 3 * 0.01


def test_at_full_share_nothing_rests():
    async def scenario():
        compute = RecordedRests(1.0)
        try:
            await compute(busy_for, 0.01)
            return compute.rests
        finally:
            compute.close()

    assert asyncio.run(scenario()) == []


def test_the_result_is_handed_on_only_after_the_rest():
    """The rest delays the caller, not just the next job: that is what slows the node's
    messages and stated throughput along with its compute."""
    resting, release = threading.Event(), threading.Event()

    class Gated(ComputeThread):
        def rest(self, seconds: float) -> None:
            resting.set()
            release.wait(10)

    async def scenario():
        compute = Gated(threads=1, share=0.5)
        try:
            call = asyncio.ensure_future(compute(lambda: "done"))
            await asyncio.get_running_loop().run_in_executor(None, resting.wait, 10)
            handed_on_early = call.done()
            release.set()
            return handed_on_early, await call
        finally:
            compute.close()

    assert asyncio.run(scenario()) == (False, "done")


def test_closing_ends_a_rest_at_once():
    resting = threading.Event()

    class Noted(ComputeThread):
        def rest(self, seconds: float) -> None:
            resting.set()  # the job is done and its rest begins: closing now cancels nothing queued
            super().rest(seconds)

    compute = Noted(threads=1, share=1e-6)  # a million times the job's time: days

    async def scenario():
        job = asyncio.ensure_future(compute(busy_for, 0.01))
        assert await asyncio.get_running_loop().run_in_executor(None, resting.wait, 60)
        closer = asyncio.get_running_loop().run_in_executor(None, compute.close)
        await asyncio.wait_for(closer, timeout=60)  # returns once the rest is cut short, not after days
        return await job

    assert asyncio.run(scenario()) >= 0.01


@pytest.mark.parametrize("share", ["0", "-0.5", "1.5", "nan"])
def test_a_share_outside_zero_to_one_is_refused_by_every_command(share, capsys):
    for argv in (["join", "--config", "x.toml", "--compute-share", share], ["local", "--compute-share",
                                                                            share]):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(argv)
        assert exc.value.code == 2
        assert "--compute-share" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ComputeThread(share=float(share))
    with pytest.raises(ValueError):
        LocalConfig(compute_share=float(share))

