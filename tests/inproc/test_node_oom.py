"""Out of device memory anywhere on the compute thread (a peer's forward request, our own
step) stops the node, which then ends with one line naming the stage, the device, the
memory the stage needs and what to change, instead of a traceback per failed request."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarm_node.node import Node
from swarm_node.node_config import NodeConfig
from swarm_node.spec import RunSpec
from swarm_node.train.device import OutOfMemory


def test_out_of_memory_on_the_compute_thread_stops_the_node_with_one_line():
    node = Node(RunSpec(run_id="oom", model_size="tiny", num_stages=2), NodeConfig())
    node.stage, node.data = 1, SimpleNamespace(vocab_size=256)

    def allocate():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    async def scenario():
        with pytest.raises(OutOfMemory) as caught:
            await node.compute(allocate)
        return caught.value

    error = asyncio.run(scenario())
    assert node._stop.is_set() and node._fatal is error
    assert "stage 1 of 2 of the tiny model" in str(error) and "try a smaller model" in str(error)
    assert "\n" not in str(error)


def test_other_failures_on_the_compute_thread_pass_unchanged():
    node = Node(RunSpec(run_id="oom", model_size="tiny", num_stages=2), NodeConfig())
    node.stage, node.data = 0, SimpleNamespace(vocab_size=256)

    def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(node.compute(broken))
    assert not node._stop.is_set() and node._fatal is None
