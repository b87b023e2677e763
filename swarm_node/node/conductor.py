"""One swarm node: joins the DHT, holds one pipeline stage, forwards micro-batches to
random next-stage peers, and pairs with a random same-stage peer every H inner steps.

The node is the conductor: it starts the pieces in order and wires them to each other
(node/startup.py, the start-up half it inherits), runs their loops in one task group,
and takes them down again. The pieces, each
testable with fakes of the others (docs/ARCHITECTURE.md has the map):

- membership/  who is in the run, our stage, our record, staying connected
- train/       the stage's worker, the data path (pipeline.py), the compute thread
- gossip/      the outer round: partner, exchange, checks
- state/       checkpoints and the late joiner's state download
- net/         the DHT, streams, reachability, and the peer guard

Concurrency: one asyncio loop owns every task (a root TaskGroup); all torch work runs
on one compute thread, so the loop never blocks and torch state is never touched by
two threads at once. Every remote call has a deadline; every queue and handler is capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial

from tqdm.contrib.logging import logging_redirect_tqdm

from swarm_node.data.source import RunData
from swarm_node.errors import ConfigError, SwarmError, known_failure
from swarm_node.gossip.exchange import OuterExchange
from swarm_node.membership.reconnect import Reconnector
from swarm_node.membership.view import Membership
from swarm_node.net import protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import DIALBACK
from swarm_node.net.guard import PeerGuard
from swarm_node.net.reaper import start_reaper
from swarm_node.net.transport import Transport, short_id
from swarm_node.node.progress_feed import ProgressFeed
from swarm_node.node.report import NodeReport
from swarm_node.node.startup import NodeStartup, bounded
from swarm_node.node_config import NodeConfig
from swarm_node.obs.endpoints import NodeStatus
from swarm_node.obs.stats import NodeStats
from swarm_node.spec import RunSpec
from swarm_node.spec_record import peer_ids_of
from swarm_node.state.keeper import Checkpoints
from swarm_node.state.sync import StateSync
from swarm_node.state.witnesses import Witnesses
from swarm_node.train.compute import ComputeThread, WireThread
from swarm_node.train.pipeline import Pipeline
from swarm_node.train.rounds import RoundGate
from swarm_node.train.worker import StageWorker

log = logging.getLogger("swarm_node.node")

HANDLERS = (protocols.FORWARD, protocols.PAIR, protocols.OUTER, protocols.OUTER_FETCH, protocols.STATE,
            protocols.STATE_SKETCH, protocols.STATUS, DIALBACK, protocols.DATA)


class Node(NodeStartup):
    def __init__(self, spec: RunSpec | None, config: NodeConfig):
        """Without a spec the node reads the run's spec from its initial peers."""
        if spec is None and not config.initial_peers:
            raise ConfigError(
                "a node needs --initial-peers (to read the run spec from the swarm) or --config"
            )
        peer_ids_of(config.initial_peers)  # a multiaddr without its /p2p/ id fails here, before start-up
        self.spec = spec
        self.spec_hash = spec.spec_hash() if spec else None
        self.config = config
        self.publisher: str | None = None  # the peer whose published spec this node follows
        self.stats = NodeStats()
        self.stopping = asyncio.Event()
        self.gate = RoundGate()
        self.compute = ComputeThread(config.threads, on_fatal=self._fail, share=config.compute_share)
        self.wire = WireThread()
        self.guard = PeerGuard(admits=lambda peer: self.spec is not None and self.spec.admits(peer),
                               max_faults=config.max_peer_faults, caller_ban_s=config.caller_ban_s)
        self.dht: SwarmDHT | None = None
        self.transport: Transport | None = None
        self.membership: Membership | None = None
        self.data: RunData | None = None
        self.worker: StageWorker | None = None
        self.pipeline: Pipeline | None = None
        self.exchange: OuterExchange | None = None
        self.state_sync: StateSync | None = None
        self.witnesses: Witnesses | None = None
        self.checkpoints: Checkpoints | None = None
        self.status_pages: NodeStatus | None = None
        self.report = NodeReport(self)  # its record, status, summary, metrics and files
        self.status = "running"
        # when the node began to train (compute utilisation's clock)
        self._training_since: float | None = None
        # the same, on the wall clock (for benchmarks' curves)
        self._training_started_unix: float | None = None
        self._last_round_opened_at: float | None = None  # time.monotonic() when the latest round began
        self._held_at_last_open = 0.0  # the gate's held time then, the hold that led to it included
        self.fatal: SwarmError | None = None  # ends run() once the node has shut down (out of memory)
        # awaited first thing at shutdown, while the node is still whole (profilers, instruments)
        self.before_shutdown: list[Callable[[], Awaitable[None]]] = []

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id if self.dht else "?"

    @property
    def stage(self) -> int | None:
        return self.membership.stage if self.membership else None

    @property
    def state(self) -> str:
        return self.membership.state if self.membership else "joining"

    def stop(self) -> None:
        self.stopping.set()

    def _fail(self, error: SwarmError) -> None:
        """The device is full: wherever it happened, the node stops and run() ends with this one line."""
        self.fatal = self.fatal or error
        self.stop()

    # -- lifecycle -----------------------------------------------------------------
    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        reaper = start_reaper()  # the DHT child and p2pd die with us, even after kill -9
        live = self.config.progress and sys.stderr.isatty()  # a live line, or a log line a minute
        # on a terminal, log lines print above the live progress line
        with logging_redirect_tqdm() if live else contextlib.nullcontext():
            try:
                await self._start(reaper.rescan)
                async with asyncio.TaskGroup() as tg:
                    membership, exchange = self.membership, self.exchange
                    after_read = exchange.meet_a_seeking_peer if not membership.reachable else None
                    loops = [membership.heartbeat_loop(), membership.registry_loop(after_read),
                             membership.publish_loop(), self._rounds(), self._progress_feed().run(log, live),
                             Reconnector(self.dht, self.config.initial_peers,
                                         check_s=self.config.connectivity_check_s,
                                         on_failure=self.stats.note_failure).run()]
                    if self.worker.is_first:
                        loops.append(self._produce())
                    elif self.config.max_steps is not None:
                        loops.append(self.pipeline.serve_to_the_limit(
                            partial(self.membership.stage_has_ended, self.stage - 1), finished=self._finish))
                    tasks = [tg.create_task(c) for c in loops]
                    await self.stopping.wait()
                    membership.state = "leaving"
                    self.status = "finished"
                    for task in tasks:
                        task.cancel()
            except BaseExceptionGroup as group:
                known = known_failure(group)  # e.g. the DHT died: one line for the user
                if known is not None:
                    raise known from None
                raise
            finally:
                await self._shutdown()
                reaper.terminate()  # we stopped our children ourselves
                await asyncio.to_thread(reaper.wait)
        if self.fatal is not None:
            raise self.fatal
        return self.report.summary()

    async def _produce(self) -> None:
        """Stage 0 drives the pipeline: its micro-batches, once the peers it waits for are up."""
        await self._wait_for_peers()
        await self.data.settle_slot(2 * max(self.config.heartbeat_s, self.config.registry_poll_s))
        await self.pipeline.produce(finished=self._finish)

    async def _finish(self) -> None:
        """Stage 0 has done max_steps: the node finishes."""
        log.info("node %s finished %d inner steps", short_id(self.peer_id), self.worker.inner_step)
        self.membership.state = "finished"
        await self.membership.heartbeat()
        # a round under way finishes before we leave: a partner may wait on our reply
        await self.gate.settled.wait()
        self.stop()

    async def _rounds(self) -> None:
        """Outer round, then metrics, then a checkpoint, whenever a round is due."""
        if self.worker.slow is None:
            return
        while True:
            await self.gate.next_round()
            self._last_round_opened_at, self._held_at_last_open = time.monotonic(), self.gate.held_now_s()
            try:
                await self.exchange.run_round()
                await self.membership.round_changed()
                if self.exchange.behind and self.config.download_state:
                    await self._catch_up_now()
            finally:
                self.gate.round_over()
            self.report.log_metrics()
            if self.worker.outer_round % self.config.checkpoint_every_rounds == 0:
                await self._save_checkpoint(f"after round {self.worker.outer_round - 1}")
            # gradients that arrived during the round may complete a step now
            await self.pipeline.step_if_ready()

    async def _catch_up_now(self) -> None:
        """A partner rounds ahead was out of our scale (we started while it trained
        alone): take the stage's most advanced state instead of drifting apart for good."""
        self.exchange.behind = False
        log.info("this node is rounds behind a peer of stage %d; downloading its state", self.stage)
        if not await self.state_sync.download():
            log.warning("no stage-%d peer could give its state; training on", self.stage)

    async def _save_checkpoint(self, why: str) -> None:
        data_position = self.pipeline.data_position if self.pipeline else lambda: None
        await self.checkpoints.save(self.worker, why, stage=self.stage, peer_id=self.peer_id,
                                    data_position=data_position)

    async def _shutdown(self) -> None:
        """Every step is bounded: a dead daemon or DHT process must not hang the exit."""
        for hook in self.before_shutdown:
            await bounded(hook(), 60.0, "running a shutdown hook")
        if self.membership is not None:
            self.membership.state = "leaving"
        if self.exchange is not None:  # a peer holding its round for our payload stops waiting for it
            await bounded(self.exchange.withdraw_abandoned(), 3.0, "withdrawing a pairing proposal")
        if self.data is not None:
            await bounded(self.data.close(), 3.0, "stopping the data prefetch")
        if self.transport is not None:
            for name in HANDLERS:
                await bounded(self.transport.stop_serving(name), 3.0, f"removing the {name} handler")
            # answers still on their way (a partner's outer payload) reach it before the daemon goes
            await bounded(self.transport.answers_delivered(), 120.0, "delivering the answers we owe")
        if self.dht is not None and self.stage is not None and self.dht.is_alive():
            # a `leaving` record: peers stop routing to us at once instead of at record expiry
            await bounded(self.membership.heartbeat(), 3.0, "publishing the leaving record")
        if self.worker is not None and self.status == "finished":  # a clean stop, not a failed start
            # bounded: a wedged compute thread must not keep SIGTERM from stopping the node
            await bounded(self._save_checkpoint("on shutdown"), 60.0, "writing the shutdown checkpoint")
        self.report.write_outputs()
        if self.report.metrics is not None:
            self.report.log_metrics()
            self.report.metrics.close()
        if self.transport is not None:
            await bounded(self.transport.close_lanes(), 3.0, "closing the direct lanes")
            await bounded(self.transport.p2p.shutdown(), 5.0, "closing the p2p client")
        if self.dht is not None:
            await bounded(self.dht.shutdown(), 15.0, "stopping the DHT")
        if self.status_pages is not None:
            await bounded(self.status_pages.close(), 3.0, "closing the status endpoints")
        self.compute.close()
        self.wire.close()
        if self.worker is not None and self.status == "finished":
            log.info("%s", self.checkpoints.how_to_resume(self.worker))

    def _progress_feed(self) -> ProgressFeed:
        return ProgressFeed(spec=self.spec, max_steps=self.config.max_steps, worker=self.worker,
                            pipeline=self.pipeline, membership=self.membership, exchange=self.exchange,
                            stats=self.stats)
