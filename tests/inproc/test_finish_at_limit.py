"""A later stage given --max-steps. It may receive more micro-batches than stage 0 counts:
a hop that stage 0 gave up on (deadline, reset) was often trained on here, and stage 0
sends a replacement. So at its limit it steps no more, but keeps answering while
micro-batches still come (leaving at once would strand stage 0 a step short), and
finishes once they stop, or after a grace when a stage 0 with no limit never stops."""

import asyncio

import torch
import vclock
from parts import StageParts

from swarm_node.data.spec import DataSpec
from swarm_node.node_config import NodeConfig
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec
from swarm_node.train import pipeline as pipeline_module
from swarm_node.train.hop_work import forward_request as encode_forward
from swarm_node.train.worker import StageWorker
from swarm_node.wire.frames import decode_frame

SPEC = RunSpec(run_id="limit", model_size="debug", num_stages=2, seq_len=16, batch_size=4, samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=50),
               inner=InnerHyper(lr=3e-3, warmup_steps=1, total_steps=100))
VOCAB = 16
LIMIT = 2


def forward_request() -> bytes:
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16),
                                                                                   generator=g)
    hidden = StageWorker(SPEC, 0, VOCAB).forward(tokens)
    return encode_forward({"kind": "fwd", "spec": SPEC.spec_hash(), "deadline_s": 30.0}, hidden, targets,
                          "fp16")


def later_stage() -> tuple[StageParts, object]:
    stage = StageParts(SPEC, StageWorker(SPEC, 1, VOCAB), config=NodeConfig(max_steps=LIMIT))
    return stage, stage.pipeline()


async def never_ended() -> bool:
    return False


def test_at_the_limit_it_answers_without_stepping_and_leaves_once_micro_batches_stop():
    stage, pipeline = later_stage()
    request = forward_request()
    finished_at: list[float] = []

    async def scenario():
        clock = asyncio.get_running_loop().time

        async def finished():
            finished_at.append(clock())

        serving = asyncio.create_task(pipeline.serve_to_the_limit(never_ended, finished))
        # two micro-batches take the two steps; then two more arrive a second apart
        # (stage 0's replacements for hops it lost): answered, not trained on
        for _ in range(LIMIT + 2):
            answer, _ = decode_frame(await pipeline.handle_forward("QmFirst", request), pipeline.frame_limits)
            assert answer["ok"], answer
            await asyncio.sleep(1.0)
        last_answer = clock()
        assert stage.worker.inner_step == LIMIT and not serving.done()
        await asyncio.wait_for(serving, 60)
        return last_answer

    last_answer = vclock.run(scenario())
    assert stage.worker.inner_step == LIMIT and stage.stats.microbatches_done == LIMIT + 2
    assert stage.worker.pending_samples == 2 * SPEC.batch_size  # held, never stepped
    quiet = finished_at[0] - last_answer
    assert pipeline_module.QUIET_AT_LIMIT_S - 1 <= quiet <= pipeline_module.QUIET_AT_LIMIT_S + 2, quiet


def test_a_stage_0_that_never_stops_sending_does_not_keep_it_past_the_grace():
    stage, pipeline = later_stage()
    request = forward_request()

    async def scenario():
        clock = asyncio.get_running_loop().time
        finished = asyncio.Event()

        async def finish():
            finished.set()

        serving = asyncio.create_task(pipeline.serve_to_the_limit(never_ended, finish))
        while stage.worker.inner_step < LIMIT:
            await pipeline.handle_forward("QmFirst", request)
        reached = clock()
        while not finished.is_set():  # a micro-batch every half second, for ever
            await pipeline.handle_forward("QmFirst", request)
            await asyncio.sleep(0.5)
        await serving
        return clock() - reached

    stayed_s = vclock.run(scenario())
    assert stage.worker.inner_step == LIMIT
    assert pipeline_module.LIMIT_GRACE_S <= stayed_s <= pipeline_module.LIMIT_GRACE_S + 2, stayed_s


def test_below_the_limit_it_finishes_once_the_stage_before_has_ended_after_it_trained():
    stage, pipeline = later_stage()
    request = forward_request()
    asked: list[float] = []

    async def scenario():
        clock = asyncio.get_running_loop().time

        async def ended() -> bool:
            asked.append(clock())
            return True

        async def finished():
            pass

        serving = asyncio.create_task(pipeline.serve_to_the_limit(ended, finished))
        await asyncio.sleep(3 * pipeline_module.UPSTREAM_CHECK_S)
        assert not asked and not serving.done()  # nothing trained yet: the run has not begun for us
        await pipeline.handle_forward("QmFirst", request)
        await asyncio.wait_for(serving, 3 * pipeline_module.UPSTREAM_CHECK_S)

    vclock.run(scenario())
    assert stage.worker.inner_step == 1 < LIMIT and len(asked) == 1
