"""The one thread a node does all torch work on.

Every forward, backward, step, (de)serialisation of big tensors and checkpoint copy of
a node runs here, so the event loop never blocks and torch state is never touched by
two threads at once. An out-of-memory failure, wherever it happens (a peer's request,
our own producer), is fatal: it becomes one line naming the model size, the device
memory and what to try, and the node is told to stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from swarm_node.errors import PeerRefused, SwarmError

Explain = Callable[[BaseException], SwarmError | None]


class ComputeThread:
    def __init__(self, threads: int | None = None, on_fatal: Callable[[SwarmError], None] = lambda error: None):
        # OpenMP keeps a thread count per OS thread: set it in the compute thread itself
        # (torch.set_num_threads on the main thread does not reach it).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                            initializer=torch.set_num_threads if threads else None,
                                            initargs=(threads,) if threads else ())
        self.on_fatal = on_fatal
        self.explain: Explain = lambda exc: None  # set once the node knows its stage and device
        self.closed = False

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.closed:  # a stream handler the daemon still runs while we shut down
            raise PeerRefused("this node is shutting down")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args, **kwargs))
        except Exception as exc:
            error = self.explain(exc)
            if error is None:
                raise
            self.on_fatal(error)
            raise error from exc

    def close(self) -> None:
        self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
