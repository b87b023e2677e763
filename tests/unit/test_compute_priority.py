"""A node's compute thread yields the CPU to its networking: it runs at a lower
priority than the event loop's thread (Linux: a thread's own nice value), and torch's
thread count is set in it."""

import asyncio
import os
import sys
import threading

import pytest
import torch

from swarm_node.train.compute import COMPUTE_NICE, ComputeThread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_compute_thread_runs_below_the_event_loop():
    async def scenario():
        compute = ComputeThread(threads=1)
        try:
            return await compute(lambda: (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                                          torch.get_num_threads()))
        finally:
            compute.close()

    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    compute_nice, threads = asyncio.run(scenario())
    assert compute_nice == min(19, loop_nice + COMPUTE_NICE) and threads == 1
