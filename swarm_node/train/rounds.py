"""The hand-over between inner steps and outer rounds.

The data path reports after each step whether a round is due; from then on no new
micro-batch enters (gradients still in flight accumulate and are stepped later) until
the round has taken what it sends. A blocking round holds the gate until its outer step
is done; an overlapped one (ALGORITHM.md section 3.1) reopens it as soon as its payload
is taken, and the exchange runs beside the inner steps. If that exchange outlasts the
next boundary, the gate stays shut there until it ends; the exchange can then keep the
next round's steps waiting first, for the partner's Delta (gossip/exchange.py). A
partner at its own boundary can also open our round early (see gossip/exchange.py).

The gate keeps the time the inner steps stood still for rounds: compute utilisation's
loss to the network."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from swarm_node.train.worker import StageWorker


class RoundGate:
    def __init__(self) -> None:
        self._due = asyncio.Event()
        self.idle = asyncio.Event()  # set while no boundary holds the steps: micro-batches may enter
        self.idle.set()
        self.settled = asyncio.Event()  # set while no round is due or under way
        self.settled.set()
        self.requested = False  # the current round was started by a waiting partner
        self._shut_at: float | None = None
        self.held_s = 0.0  # total time boundaries held the steps
        # whether a round's payload is moving now (gossip/exchange.py sets it): stage 0
        # holds its micro-batches in flight to one meanwhile (train/pipeline.py)
        self.payload_on_link: Callable[[], bool] = lambda: False

    @property
    def in_round(self) -> bool:
        return not self.settled.is_set()

    def note_due(self, due: bool) -> None:
        if due and self.idle.is_set():
            self._shut()
            self._due.set()

    def open_early(self) -> None:
        """A partner waits for us: start our round now."""
        self.requested = True
        if self.idle.is_set():
            self._shut()
        self._due.set()

    async def next_round(self) -> None:
        await self._due.wait()
        self._due.clear()

    def resume_steps(self) -> None:
        """An overlapped round has taken its payload: steps go on beside the exchange."""
        self._reopen()

    def held_now_s(self) -> float:
        """``held_s`` with the hold under way now, if any."""
        if self.idle.is_set() or self._shut_at is None:
            return self.held_s
        return self.held_s + asyncio.get_running_loop().time() - self._shut_at

    @property
    def shut_at(self) -> float | None:
        """When the steps last stood still (the loop's clock): at a round's start, its
        boundary, where the last round's steps ended."""
        return self._shut_at

    def round_over(self) -> None:
        self.requested = False
        if not self._due.is_set():  # the next boundary came while this round ran: it keeps the gate shut
            self._reopen()
            self.settled.set()

    def _shut(self) -> None:
        self.idle.clear()
        self.settled.clear()
        self._shut_at = asyncio.get_running_loop().time()

    def _reopen(self) -> None:
        if not self.idle.is_set():
            self.held_s += asyncio.get_running_loop().time() - self._shut_at
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
