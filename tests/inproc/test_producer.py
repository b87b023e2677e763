"""Stage 0's producer loop near --max-steps. Gradients that arrive during an outer round
wait for the step after it; when they alone cover the last steps, the producer must
still take that step instead of looping without ever yielding to the event loop (which
froze a node for good in the first chaos run: no round, no log, no SIGTERM)."""

import asyncio

import pytest
import torch
import vclock
from parts import StageParts, body_out, record

from swarm_node.data.dataset import load_windows
from swarm_node.data.source import RunData
from swarm_node.data.spec import DataSpec
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train.compute import ComputeThread
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame

SPEC = RunSpec(run_id="producer", model_size="debug", num_stages=1, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))


@pytest.mark.timeout(60)
def test_gradients_held_over_a_round_finish_the_run_without_starving_the_loop():
    max_steps = 3
    data = load_windows(SPEC.data, SPEC.seq_len)
    compute = ComputeThread(threads=1)  # the node's: the producer must yield while torch works
    stage = StageParts(SPEC, StageWorker(SPEC, 0, data.vocab_size), config=NodeConfig(max_steps=max_steps),
                       compute=compute)
    pipeline = stage.pipeline()
    pipeline.open_data(RunData.in_memory(SPEC, data), "QmSelf", resumed=None)
    worker = stage.worker
    g = torch.Generator().manual_seed(0)
    worker.forward_backward_last(None, torch.randint(0, 16, (4, 16), generator=g),
                                 torch.randint(0, 16, (4, 16), generator=g))
    worker.step()
    worker.step()  # two steps done, one to go
    for _ in range(2):  # two micro-batches' gradients came in while a round was open
        worker.forward_backward_last(None, torch.randint(0, 16, (4, 16), generator=g),
                                     torch.randint(0, 16, (4, 16), generator=g))
    assert worker.inner_step == max_steps - 1 and worker.ready_to_step() and pipeline.issued_enough()

    finished = []

    async def finish():
        finished.append(worker.inner_step)

    async def scenario():
        ticks = 0

        async def ticker():  # proves the event loop stays free while the producer works
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        try:
            async with asyncio.timeout(30):
                await pipeline.produce(finished=finish)
        finally:
            ticking.cancel()
        return ticks

    try:
        ticks = asyncio.run(scenario())
    finally:
        compute.close()
    assert worker.inner_step == max_steps and pipeline.reached_max_steps()
    assert finished == [max_steps] and ticks >= 1
    assert stage.stats.microbatches_done == 0  # the last step came from the held gradients alone


def test_stage_0_waits_for_a_next_stage_peer_instead_of_losing_micro_batches():
    """The first volunteer of a two-stage run draws nothing until a stage-1 peer is
    known (it used to lose a micro-batch every hop deadline, and showed as failing),
    and stops cleanly while it waits."""
    spec = RunSpec(run_id="producer", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
                   samples_per_step=4, data=DataSpec(kind="synthetic"),
                   method=default_method("noloco", inner_steps=50))
    data = load_windows(spec.data, spec.seq_len)
    stage = StageParts(spec, StageWorker(spec, 0, data.vocab_size))
    pipeline = stage.pipeline()
    pipeline.open_data(RunData.in_memory(spec, data), "QmSelf", resumed=None)
    before = pipeline.loader.state_dict()
    finished = []

    async def finish():
        finished.append(True)

    async def scenario():
        producing = asyncio.create_task(pipeline.produce(finished=finish))
        await asyncio.sleep(120)  # virtual: two hop deadlines and more
        assert pipeline.waiting_for_next_stage and pipeline.in_flight == 0 and not producing.done()
        stage.stopping.set()
        await asyncio.wait_for(producing, 5)

    vclock.run(scenario())
    assert finished == [True] and stage.stats.microbatches_lost == 0
    assert pipeline.loader.state_dict() == before  # nothing was drawn


def test_stage_0_keeps_as_many_micro_batches_in_flight_as_its_window_says():
    """The producer keeps out what the window (routing/window.py, whose arithmetic
    tests/unit/test_in_flight_window.py pins) says, no more; a window that grows lets
    more out at once, one that shrinks lets those out finish before it draws again."""
    spec = RunSpec(run_id="producer", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
                   samples_per_step=4, data=DataSpec(kind="synthetic"),
                   method=default_method("noloco", inner_steps=50))
    data = load_windows(spec.data, spec.seq_len)
    hidden_size = StageWorker(spec, 0, data.vocab_size).model_config.hidden_size
    answer = encode_frame({"ok": True, "loss": 2.0},
                          encode_activations(torch.zeros(4, 16, hidden_size), "fp16"))
    held: list[asyncio.Future] = []

    class NextStage:
        async def request(self, peer, protocol, payload, *, timeout_s, max_response_bytes, **pacing):
            body_out(pacing)  # the answer is held
            held.append(asyncio.get_running_loop().create_future())
            await held[-1]
            return answer

    class Window:  # sizes set by the test; what the pipeline notes is kept
        def __init__(self):
            self.depth, self.noted = 2, 0

        def note(self, compute_s, wait_s):
            self.noted += compute_s > 0 and wait_s >= 0

        def sent(self, now):
            return 0, now

        def delivered(self, mark, now):
            pass

        def deadline_s(self, in_flight, floor_s, cap_s):
            return floor_s

        def paced_share(self):
            return None  # never link-bound here

        def size(self, next_stage_accepts):
            assert next_stage_accepts == 4  # one next-stage peer, which serves a caller 4 at once
            return self.depth

    stage = StageParts(spec, StageWorker(spec, 0, data.vocab_size), transport=NextStage())
    stage.membership.peers = {1: {"QmNext": record(1, spec)}}
    stage.guard.reached("QmNext")
    pipeline = stage.pipeline()
    pipeline.window = window = Window()
    pipeline.open_data(RunData.in_memory(spec, data), "QmSelf", resumed=None)

    async def release(count: int) -> int:
        for future in [f for f in held if not f.done()][:count]:
            future.set_result(None)
        await asyncio.sleep(5)
        return pipeline.in_flight

    async def scenario():
        producing = asyncio.create_task(pipeline.produce(finished=lambda: asyncio.sleep(0)))
        seen = [await release(0)]
        window.depth = 7  # as measured when a micro-batch comes back
        seen.append(await release(1))
        window.depth = 3
        seen.append(await release(2))  # 5 left: none drawn
        seen.append(await release(3))  # 2 left: one drawn
        stage.stopping.set()
        while not producing.done():
            await release(len(held))
        return seen

    assert vclock.run(scenario()) == [2, 7, 5, 3]
    assert stage.stats.microbatches_lost == 0 and window.noted == len(held)
