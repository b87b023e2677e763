"""The hand-over between inner steps and outer rounds.

The data path reports after each step whether a round is due; from then on no new
micro-batch enters until the round is over (gradients still in flight accumulate and
are stepped after it). The outer exchange waits for a due round, runs it, and reopens
the gate. A partner at its own boundary can also open our round early (see
gossip/exchange.py)."""

from __future__ import annotations

import asyncio

from swarm_node.train.worker import StageWorker


class RoundGate:
    def __init__(self) -> None:
        self._due = asyncio.Event()
        self.idle = asyncio.Event()  # set while no round is due or running: micro-batches may enter
        self.idle.set()
        self.requested = False  # the current round was started by a waiting partner

    @property
    def in_round(self) -> bool:
        return not self.idle.is_set()

    def note_due(self, due: bool) -> None:
        if due and self.idle.is_set():
            self.idle.clear()
            self._due.set()

    def open_early(self) -> None:
        """A partner waits for us: start our round now."""
        self.requested = True
        self.idle.clear()
        self._due.set()

    async def next_round(self) -> None:
        await self._due.wait()
        self._due.clear()

    def round_over(self) -> None:
        self.requested = False
        self.idle.set()


def step_if_ready(worker: StageWorker) -> tuple[bool, bool]:
    """On the compute thread: step if enough samples are in and no outer round is
    pending; report (stepped, round now due). Checking both in one call keeps two
    queued calls from stepping past a round boundary."""
    stepped = False
    if not worker.outer_round_due() and worker.ready_to_step():
        worker.step()
        stepped = True
    return stepped, worker.outer_round_due()


def force_round_if_ready(worker: StageWorker) -> bool:
    """On the compute thread: end the round's inner steps now if past half of them."""
    if worker.outer_round_due() or not worker.can_round_early():
        return False
    worker.force_round()
    return True
