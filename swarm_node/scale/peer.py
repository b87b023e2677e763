"""One simulated peer: the node's components, wired as node.py wires them, around a
model-free stage (scale/stage.py) and the modelled network (scale/network.py).

Real: Membership (heartbeats, registry reads, the partner candidates), PeerGuard,
OuterExchange with its PairingCoordinator or GroupRound and partner checks, RoundGate,
PeerChooser. Modelled: the inner steps (a time drawn per step), and a forward's trip
(its answer comes back over the links; the next stages' compute is not simulated)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm_node import __version__
from swarm_node.errors import PeerError
from swarm_node.gossip.exchange import ExchangeTimes, OuterExchange
from swarm_node.membership.reachability import Reachability
from swarm_node.membership.view import Membership
from swarm_node.net import protocols
from swarm_node.net.guard import PeerGuard
from swarm_node.net.transport import ServeLimits
from swarm_node.node_config import NodeConfig
from swarm_node.node_services import NodeServices
from swarm_node.obs.stats import NodeStats
from swarm_node.routing.chooser import Candidate, PeerChooser
from swarm_node.scale.network import Endpoint, Network, SimDHT, SimTransport
from swarm_node.scale.stage import TinyStage
from swarm_node.spec import RunSpec
from swarm_node.train.rounds import RoundGate
from swarm_node.wire.messages import answer_is_yes
from swarm_node.wire.records import PeerRecord

CONTROL = {protocols.PAIR: "pairing", protocols.OUTER: "exchange-control",
           protocols.OUTER_FETCH: "exchange-control"}


async def inline(fn, *args, **kwargs):
    """The compute thread's stand-in: the work is a few dozen weights."""
    return fn(*args, **kwargs)


# The outer round's work on the compute thread, by the name of the call the exchange
# makes (tests/inproc/test_scale.py holds these names to the code): what the model-free
# stage does in no time takes a real model's seconds where the run says so.
OUTER_WORK = {"open_round": "prepare", "_decode_and_check": "check", "close_round": "close"}


def timed_compute(round_work_s: dict[str, float]):
    """A compute stand-in that takes ``round_work_s[part]`` virtual seconds for the outer
    round's parts (prepare, check, close) after doing the work."""
    async def compute(fn, *args, **kwargs):
        result = fn(*args, **kwargs)
        seconds = round_work_s.get(OUTER_WORK.get(getattr(fn, "__name__", ""), ""), 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)
        return result
    return compute


@dataclass
class RoundRecord:
    peer: str
    stage: int
    round_no: int
    started_at: float
    ended_at: float
    partners: int
    partner: str | None  # the first, for the round trips to it
    proposals: int
    to_partner_s: float | None
    alone: bool  # nobody else was in the stage as this peer saw it


@dataclass
class ForwardCounts:
    sent: int = 0
    to_dead: int = 0  # the chosen peer had crashed (its record not yet expired)
    to_unreachable: int = 0
    failed: int = 0
    lost: int = 0  # gave up after every retry, or no peer to send to


@dataclass
class PeerCounters:
    refusals: int = 0
    forwards: ForwardCounts = field(default_factory=ForwardCounts)


class SimPeer:
    def __init__(self, *, spec: RunSpec, config: NodeConfig, network: Network, endpoint: Endpoint, stage: int,
                 step_s: float, step_jitter_sigma: float, payload_bytes: int, rng: random.Random,
                 on_round: Callable[[RoundRecord], None], round_work_s: dict[str, float] | None = None):
        self.peer_id = endpoint.peer_id
        self.spec, self.config, self.network, self.endpoint = spec, config, network, endpoint
        self.step_s, self.step_jitter_sigma = step_s, step_jitter_sigma
        self.rng = rng
        self.on_round = on_round
        self.compute = timed_compute(round_work_s) if round_work_s else inline
        self.counters = PeerCounters()
        clock = asyncio.get_running_loop().time
        self.guard = PeerGuard(clock=clock, max_faults=config.max_peer_faults,
                               caller_ban_s=config.caller_ban_s)
        endpoint.on_reached = self.guard.reached
        self.stats = NodeStats()
        self.gate, self.stopping = RoundGate(), asyncio.Event()
        self.exchange: OuterExchange | None = None
        self.worker = TinyStage(spec, stage, seed=rng.randrange(1 << 30))
        self.dht = SimDHT(network, self.peer_id, virtual_wall_clock)
        self.transport = SimTransport(network, self.peer_id, CONTROL.get, on_answer=self.note_answer)
        self.membership = Membership(spec=spec, dht=self.dht, guard=self.guard, config=config,
                                     record=self.record)
        self.membership.stage = stage
        if not endpoint.reachable:  # what its dial-back check found at start (membership/reachability.py)
            self.membership.reachability = Reachability(reachable=False)
        self.chooser = PeerChooser(is_banned=self.guard.is_banned, rng=random.Random(rng.random()))
        self.payload_bytes = payload_bytes
        self.tasks: list[asyncio.Task] = []
        self._next_view: dict | None = None  # the view of the next stage that _next_candidates was built from
        self._next_candidates: list[Candidate] = []

    @property
    def stage(self) -> int:
        return self.membership.stage

    @property
    def is_last(self) -> bool:
        return self.stage == self.spec.num_stages - 1

    def record(self) -> PeerRecord:
        stats, worker = self.stats, self.worker
        return PeerRecord(stage=self.stage, spec_hash=self.membership.spec_hash, version=__version__,
                          state=self.membership.state, throughput=round(1.0 / self.step_s, 3),
                          inner_step=worker.inner_step, outer_round=worker.outer_round,
                          seeking=self.exchange is not None and self.exchange.seeking,
                          round_step=worker.inner_step - worker.last_round_step,
                          partner_rounds=stats.rounds_with_partner, local_rounds=stats.local_only_rounds,
                          last_error=stats.last_error, reachable=self.membership.reachable,
                          recent_steps=0, recent_microbatches=0)

    # -- life -----------------------------------------------------------------------
    async def start(self, donor: SimPeer | None) -> None:
        """Join: state from a donor (a late joiner's download), serve, announce, run."""
        if donor is not None:
            self.worker.take_state_of(donor.worker)
        services = NodeServices(self.compute, self.transport, self.guard, self.stats)
        times = ExchangeTimes(self.config.round_timeout_s,
                              self.config.exchange_timeout_for(self.payload_bytes),
                              link_s=self.config.exchange_link_s(self.payload_bytes))
        self.exchange = OuterExchange(
            spec_hash=self.membership.spec_hash, method=self.spec.method.name, times=times, state=self.worker,
            services=services, gate=self.gate, candidates=self.membership.partner_candidates,
            callers_expected=self.membership.callers_expected, announce=self.membership.round_changed,
            stopping=self.stopping, own_id=self.peer_id, max_update_ratio=self.config.max_update_ratio)
        # back-offs and picks: the run's seed decides
        self.exchange.pairing.rng = random.Random(self.rng.random())
        await self.exchange.serve(self.transport, self.guard.admit)
        await self.transport.serve(protocols.FORWARD, self._serve_forward, _FORWARD_LIMITS, self.guard.admit)
        await self.membership.refresh()
        self.membership.state = "training"
        await self.membership.heartbeat()
        after_read = self.exchange.meet_a_seeking_peer if not self.membership.reachable else None
        self.tasks = [asyncio.create_task(c) for c in (
            self.membership.heartbeat_loop(), self.membership.registry_loop(after_read), self._rounds(),
            self._steps())]

    def crash(self) -> None:
        self.network.crash(self.peer_id)
        for task in self.tasks:
            task.cancel()

    async def leave(self) -> None:
        """A graceful leave: the leaving record out, then gone."""
        self.membership.state = "leaving"
        self.stopping.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.membership.heartbeat()
        self.network.crash(self.peer_id)

    # -- loops ----------------------------------------------------------------------
    def _step_time(self) -> float:
        return self.step_s * self.rng.lognormvariate(0.0, self.step_jitter_sigma)

    async def _steps(self) -> None:
        in_flight = asyncio.Semaphore(self.config.max_in_flight)
        forwards: set[asyncio.Task] = set()
        while True:
            await self.gate.idle.wait()
            if not self.is_last:
                await in_flight.acquire()  # the pipeline's cap on micro-batches in flight
                task = asyncio.create_task(self._forward(in_flight))
                forwards.add(task)
                task.add_done_callback(forwards.discard)
            await asyncio.sleep(self._step_time())
            await self.gate.idle.wait()  # a partner may have opened our round meanwhile
            self.worker.step()
            self.gate.note_due(self.worker.outer_round_due())

    async def _forward(self, in_flight: asyncio.Semaphore) -> None:
        counts = self.counters.forwards
        try:
            for _ in range(self.config.hop_retries):
                peer = self.chooser.choose(self._next_stage_candidates())
                if peer is None:
                    break
                target = self.network.endpoints[peer]
                counts.sent += 1
                counts.to_dead += not target.alive
                counts.to_unreachable += target.alive and not target.reachable
                self.chooser.started(peer)
                try:
                    await self.network.instant_call(self.peer_id, peer, protocols.FORWARD, b"f", b"k",
                                                    self.config.hop_timeout_s)
                    self.guard.succeeded(peer)
                    return
                except PeerError:
                    counts.failed += 1
                    self.guard.failed(peer)
                finally:
                    self.chooser.finished(peer)
            counts.lost += 1
        finally:
            in_flight.release()

    def _next_stage_candidates(self) -> list[Candidate]:
        """The next stage's peers as the chooser takes them, built again only when the view
        of that stage changed (Membership replaces it at each read): a forward every inner
        step rebuilt it each time."""
        view = self.membership.peers.get(self.stage + 1)
        if view is not self._next_view:
            self._next_view = view
            self._next_candidates = [Candidate(p, r.throughput, r.queue)
                                     for p, r in self.membership.next_stage_peers().items()]
        return self._next_candidates

    async def _serve_forward(self, remote: str, request: bytes) -> bytes:
        return b"k"

    async def _rounds(self) -> None:
        """node.py's round loop: the round, our record out, the gate open again."""
        while True:
            await self.gate.next_round()
            try:
                outcome = await self.exchange.run_round()
                await self.membership.round_changed()
            finally:
                self.gate.round_over()
            to_partner = (outcome.partner_at - outcome.started_at
                          if outcome.partners and outcome.partner_at is not None else None)
            self.on_round(RoundRecord(self.peer_id, self.stage, outcome.round_no, outcome.started_at,
                                      outcome.ended_at, len(outcome.partners),
                                      outcome.partners[0] if outcome.partners else None, outcome.proposals,
                                      to_partner,
                                      alone=outcome.alone))

    def note_answer(self, protocol: str, answer: bytes) -> None:
        if protocol == protocols.PAIR and not answer_is_yes(answer)[0]:
            self.counters.refusals += 1


def virtual_wall_clock() -> float:
    """Wall-clock seconds on the virtual clock: records' expiries and the views that drop
    them must move with simulated time (on time.time() a crashed peer's record, stamped
    in virtual seconds, outlived the whole run)."""
    return VIRTUAL_EPOCH_S + asyncio.get_running_loop().time()


VIRTUAL_EPOCH_S = 1.8e9  # a wall-clock date for the virtual clock's zero

_FORWARD_LIMITS = ServeLimits(max_request_bytes=1 << 20, max_concurrent=32, max_per_peer=8,
                              handler_timeout_s=30.0)
