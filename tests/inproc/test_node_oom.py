"""Out of device memory anywhere on the compute thread (a peer's forward request, our own
step) stops the node, which then ends with one line naming the stage, the device, the
memory the stage needs and what to change, instead of a traceback per failed request."""

import asyncio
from functools import partial

import pytest
import torch

from swarm_node.node.conductor import Node
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.train.device import OutOfMemory, explain_run_oom

SPEC = RunSpec(run_id="oom", model_size="tiny", num_stages=2)


def node_at(stage: int) -> Node:
    """A node that knows its stage: from then on its compute thread explains OOMs."""
    node = Node(SPEC, NodeConfig())
    node.compute.explain = partial(explain_run_oom, spec=SPEC, stage=stage, vocab_size=256, device="cpu")
    return node


def test_out_of_memory_on_the_compute_thread_stops_the_node_with_one_line():
    node = node_at(1)

    def allocate():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    async def scenario():
        with pytest.raises(OutOfMemory) as caught:
            await node.compute(allocate)
        return caught.value

    error = asyncio.run(scenario())
    assert node.stopping.is_set() and node.fatal is error
    assert "stage 1 of 2 of the tiny model" in str(error) and "try a smaller model" in str(error)
    assert "\n" not in str(error)


def test_other_failures_on_the_compute_thread_pass_unchanged():
    node = node_at(0)

    def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(node.compute(broken))
    assert not node.stopping.is_set() and node.fatal is None
