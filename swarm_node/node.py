"""One swarm node: joins the DHT, holds one pipeline stage, forwards micro-batches to
random next-stage peers, and pairs with a random same-stage peer every H inner steps.

Concurrency: one asyncio loop owns every task (a root TaskGroup); all torch work and
all (de)serialisation of big tensors run on one dedicated compute thread, so the
loop never blocks and torch state is never touched by two threads at once. Every
remote call has a deadline; every queue and handler is capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from swarm_node import __version__
from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.data.shards import ShardedBatches
from swarm_node.discovery import SPEC_REPUBLISH_S, find_run_spec, peer_ids_of, publish_spec, require_version
from swarm_node.errors import (
    ConfigError,
    IncompatibleRun,
    NotEnoughPeers,
    PeerError,
    PeerRefused,
    ProtocolError,
    StreamClosed,
    SwarmError,
    known_failure,
)
from swarm_node.gossip.group import GroupRound
from swarm_node.gossip.pairing import PairingCoordinator, PairResult, Refused
from swarm_node.net import protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.reach import (
    DIALBACK,
    Reachability,
    address_scope,
    check_reachability,
    ordered_for_others,
    serve_dialback,
    tcp_ports,
)
from swarm_node.net.transport import ServeLimits, Transport, short_id
from swarm_node.node_config import NodeConfig
from swarm_node.registry import publish_record, read_stage
from swarm_node.routing.chooser import Candidate, PeerChooser
from swarm_node.spec import RunSpec
from swarm_node.node_status import NodeStatus, handle_status_request
from swarm_node.obs.progress import NodeProgress, NodeSnapshot
from swarm_node.obs.recent import RecentGrowth
from swarm_node.obs.sinks import Sinks, open_sinks
from swarm_node.statesync import StateSync
from swarm_node.system import raise_open_file_limit
from swarm_node.train.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from swarm_node.train.device import explain_run_oom
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.train.worker import StageWorker, finite, throughput_ema
from swarm_node.wire.codec import WIRE_PRECISIONS, FrameLimits, decode_frame, encode_frame
from swarm_node.wire.records import PeerRecord

log = logging.getLogger("swarm_node.node")

MAX_KNOWN_PEERS = 32
MAX_REDIAL_S = 20.0  # an initial peer that is down is dialled again at most this far apart
STAGE_SETTLE_PASSES = 3  # looks at the joiners' announced stages before taking one for good
MAX_TRACKED_PEERS = 4096  # bound on per-peer bookkeeping, whatever number of ids an attacker uses
PROPOSE_TIMEOUT_S = 5.0  # a pairing proposal is a few bytes: no answer in this time means the peer is unwell
PROPOSAL_MAX_BYTES = 4096
PROPOSAL_LIMITS = FrameLimits(max_header_bytes=PROPOSAL_MAX_BYTES, max_payload_bytes=0, max_tensors=0)


@dataclass
class NodeStats:
    microbatches_done: int = 0
    microbatches_lost: int = 0
    retries: int = 0
    rounds_with_partner: int = 0
    local_only_rounds: int = 0
    tokens: int = 0
    partners: list[str] = field(default_factory=list)
    downloaded_from: str | None = None
    resumed_from_step: int | None = None
    downloaded_digest: str | None = None
    served_digests: list[str] = field(default_factory=list)


class Node:
    def __init__(self, spec: RunSpec | None, config: NodeConfig):
        """Without a spec the node reads the run's spec from its initial peers."""
        if spec is None and not config.initial_peers:
            raise ConfigError("a node needs --initial-peers (to read the run spec from the swarm) or --config")
        peer_ids_of(config.initial_peers)  # a multiaddr without its /p2p/ id fails here, before start-up
        self.spec = spec
        self.config = config
        self.spec_hash = spec.spec_hash() if spec else None
        self.pairing: PairingCoordinator | GroupRound | None = None
        self.stats = NodeStats()
        self.chooser = PeerChooser()
        self.publisher: str | None = None  # the peer whose published spec this node follows
        self._last_error = ""
        self._known_peers: dict[str, list[str]] = {}  # peer -> addresses, for re-bootstrapping
        self.peers: dict[int, dict[str, PeerRecord]] = {}
        # OpenMP keeps a thread count per OS thread: set it in the compute thread itself
        # (torch.set_num_threads on the main thread does not reach it).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                           initializer=torch.set_num_threads if config.threads else None,
                                           initargs=(config.threads,) if config.threads else ())
        self._compute_closed = False
        self._stop = asyncio.Event()
        self._round_due = asyncio.Event()
        self._round_idle = asyncio.Event()
        self._round_idle.set()
        self._round_requested = False  # the current round was started by a waiting partner
        self._queue = 0
        self._in_flight = 0
        self._throughput = 0.0
        self._state = "joining"
        self._ignored_peers: set[str] = set()
        self._faults: dict[str, int] = {}  # bad requests per caller since its last ban
        self._caller_bans: dict[str, float] = {}  # caller -> monotonic time its ban ends
        self._outer_reply: bytes | None = None
        self.stage: int | None = None
        self.worker: StageWorker | None = None
        self.dht: SwarmDHT | None = None
        self.transport: Transport | None = None
        self.data: TokenWindows | None = None
        self.loader: ShardedBatches | None = None
        # Magnitude screens for what peers send (see train/screen.py). The outer ones are
        # used on the event loop, the activation one only on the compute thread.
        self._delta_screen = MagnitudeScreen(config.max_update_ratio)
        self._distance_screen = MagnitudeScreen(config.max_update_ratio)
        self._activation_screen = MagnitudeScreen(config.max_activation_ratio, window=64)
        self._gradient_screen = MagnitudeScreen(config.max_activation_ratio, window=64)
        self._resume_data: dict | None = None  # data position from the checkpoint resumed
        self.status_pages: NodeStatus | None = None
        self.metrics: Sinks | None = None
        self.status = "running"
        self.reachability: Reachability | None = None  # what peers measured dialling us back
        self._fatal: SwarmError | None = None  # ends run() once the node has shut down (out of memory)
        self._last_checkpoint: Path | None = None
        self._streams_closed: dict[str, int] = {}  # next-stage peer -> streams ended unanswered in a row
        self._recent_steps = RecentGrowth()
        self._recent_microbatches = RecentGrowth()
        self._token_rate = RecentGrowth(window_s=30.0)
        self._loss_seen: float | None = None  # EMA of the losses the last stage reports back to us
        self._last_round: tuple[int, str | None, float] | None = None  # (round, partner, monotonic time)

    # -- helpers -----------------------------------------------------------------
    async def compute(self, fn, *args, **kwargs):
        if self._compute_closed:  # a stream handler the daemon still runs while we shut down
            raise PeerRefused("this node is shutting down")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, partial(fn, *args, **kwargs))
        except Exception as exc:
            if self.stage is None or self.data is None:
                raise
            error = explain_run_oom(exc, self.spec, stage=self.stage, vocab_size=self.data.vocab_size,
                                    device=self.config.device)
            if error is None:
                raise
            # The device is full: wherever it happened (a peer's request, our producer),
            # the node stops and run() ends with this one line.
            self._fatal = self._fatal or error
            self.stop()
            raise error from exc

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id if self.dht else "?"

    def stop(self) -> None:
        self._stop.set()

    @property
    def reachable(self) -> bool:
        """False once peers tried to dial us back and could not (unknown counts as reachable)."""
        return self.reachability is None or self.reachability.reachable is not False

    def _note_failure(self, what: str) -> None:
        self._last_error = what[:160]

    def _record(self) -> PeerRecord:
        w = self.worker
        return PeerRecord(stage=self.stage, spec_hash=self.spec_hash, version=__version__, state=self._state,
                          throughput=round(self._throughput, 3), queue=self._queue,
                          inner_step=w.inner_step if w else 0, outer_round=w.outer_round if w else 0,
                          seeking=self.pairing.state.value in ("seeking", "proposing"),
                          loss=round(w.loss_ema, 5) if w and w.loss_ema is not None else None,
                          tokens=self.stats.tokens, lost=self.stats.microbatches_lost,
                          partner_rounds=self.stats.rounds_with_partner, local_rounds=self.stats.local_only_rounds,
                          last_error=self._last_error, reachable=self.reachable,
                          recent_steps=self._recent_steps.sample(w.inner_step if w else 0),
                          recent_microbatches=self._recent_microbatches.sample(self.stats.microbatches_done))

    def _adopt_spec(self, spec: RunSpec) -> None:
        self.spec = spec
        self.spec_hash = spec.spec_hash()
        cfg = self.config
        if spec.method.name == "diloco":  # every live peer of the stage
            self.pairing = GroupRound(round_timeout_s=cfg.round_timeout_s, request_timeout_s=cfg.exchange_timeout_s)
        else:  # NoLoCo: one random partner
            self.pairing = PairingCoordinator(round_timeout_s=cfg.round_timeout_s,
                                              request_timeout_s=cfg.exchange_timeout_s,
                                              propose_timeout_s=PROPOSE_TIMEOUT_S, own_id=self.peer_id)

    # -- lifecycle -----------------------------------------------------------------
    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        # on a terminal, log lines print above the live progress line
        with logging_redirect_tqdm() if self._live_progress() else contextlib.nullcontext():
            try:
                await self._start()
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(self._heartbeat_loop()), tg.create_task(self._registry_loop()),
                             tg.create_task(self._outer_loop()), tg.create_task(self._publish_loop()),
                             tg.create_task(self._connectivity_loop()), tg.create_task(self._progress_loop())]
                    if self.worker.is_first:
                        tasks.append(tg.create_task(self._producer_loop()))
                    await self._stop.wait()
                    self._state = "leaving"
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
        if self._fatal is not None:
            raise self._fatal
        return self.summary()

    async def _start(self) -> None:
        cfg = self.config
        raise_open_file_limit()
        if cfg.http_port is not None:  # first, so a slow start shows as "joining" rather than as nothing
            self.status_pages = NodeStatus(self)
            await self.status_pages.start(cfg.http_host, cfg.http_port)
        self.dht = await SwarmDHT.start(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                                        announce_maddrs=cfg.announce_maddrs, identity_path=cfg.identity_path,
                                        client_mode=cfg.client_mode, startup_timeout_s=cfg.startup_timeout_s)
        self.transport = Transport(await self.dht.replicate_p2p())
        if cfg.initial_peers:
            spec, self.publisher = await find_run_spec(self.dht, cfg.initial_peers, run_id=cfg.run_id,
                                                       local_spec=self.spec, timeout_s=cfg.spec_find_timeout_s)
        else:
            require_version(self.spec.run_id, self.spec.min_version)
            spec = self.spec
        self._adopt_spec(spec)
        if not spec.admits(self.peer_id):
            raise IncompatibleRun(f"run {spec.run_id!r} is closed and this node's peer id {self.peer_id} is not on "
                                  "its list; send the id to the run's host and start again with the same --identity")
        self.data = await self.compute(load_windows, self.spec.data, self.spec.seq_len)
        await self._refresh_registry(all_stages=True)
        await self._check_reachability()
        resume = await self._find_checkpoint()
        if resume is not None:
            self.stage = resume[1]["stage"]  # rejoin the stage the checkpoint holds
        else:
            self.stage = cfg.stage if cfg.stage is not None else await self._pick_stage()
        if not 0 <= self.stage < self.spec.num_stages:
            raise SwarmError(f"stage {self.stage} does not exist: this run has {self.spec.num_stages} stages")
        if self.stage > 0 and not self.reachable:
            where = "the checkpoint holds" if resume is not None else "--stage asks for"
            raise ConfigError(f"{where} stage {self.stage}, which needs connections from other peers, but none can "
                              f"reach this node: {self._open_port_advice()}; or start without --stage (and with "
                              "a new --checkpoint-dir) to train stage 0, which only calls out")
        self.worker = await self.compute(StageWorker, self.spec, self.stage, self.data.vocab_size, cfg.device)
        log.info("node %s: stage %d of %d, %d parameters, run %s (spec %s)", short_id(self.peer_id), self.stage,
                 self.spec.num_stages, sum(p.numel() for p in self.worker.params), self.spec.run_id,
                 self.spec_hash)
        if self.reachable:
            maddrs = ordered_for_others(self.dht.visible_maddrs())
            log.info("others can join through this node with --initial-peers %s", maddrs[0] if maddrs else "?")
        self.state_sync = StateSync(self)
        if resume is not None:
            await self._resume_from(*resume)
            behind = self._steps_behind_stage()
            if cfg.download_state and behind > cfg.catch_up_rounds * self.spec.method.inner_steps:
                log.warning("the checkpoint is %d inner steps behind the most advanced peer of stage %d; catching "
                            "up by downloading its state (inner optimizer state and data position stay ours)",
                            behind, self.stage)
                if not await self.state_sync.download():
                    log.warning("no stage-%d peer could give its state; continuing from the checkpoint", self.stage)
        elif cfg.download_state and self._steps_behind_stage() > 0 and not await self.state_sync.download():
            log.warning("no stage-%d peer could give its state; starting from the run's initial weights", self.stage)
        await self._serve()
        self._open_metrics()
        self._state = "training"
        await self._heartbeat()
        await _bounded(publish_spec(self.dht, self.spec), 10.0, "publishing the run spec")

    # -- reachability ----------------------------------------------------------------
    async def _check_reachability(self) -> None:
        """Ask peers to dial us back on a fresh connection. A node nobody can dial runs
        its DHT as a client, tells the others (its record says so), and takes only roles
        that need no inbound connection: stage 0, and pairs it proposes itself."""
        if self.dht.client_mode:  # asked for, or hivemind's own check failed already
            self.reachability = Reachability(False)
            return
        ports = tcp_ports(self.dht.visible_maddrs())
        if not ports:  # listening on loopback only
            if all(address_scope(m) == "loopback" for m in self.config.initial_peers):
                return  # a swarm on this machine, where everyone can dial everyone
            log.warning("this node listens on loopback only (%s), so peers on other machines cannot reach it: it "
                        "trains stage 0 and starts its own pairings, and nobody routes work to it. To take any "
                        "stage, listen on every interface: leave out --host-maddrs", " ".join(self.config.host_maddrs))
            await self._become_client(Reachability(False))
            return
        others = [p for s in range(self.spec.num_stages) for p in self.callable_peers(s)]
        random.shuffle(others)
        servers = [*peer_ids_of(self.config.initial_peers), *others]
        self.reachability = result = await check_reachability(self.transport, servers, ports)
        if result.reachable is None:
            log.warning("could not check whether other peers can reach this node (no peer answered a dial-back "
                        "request); assuming they can")
        elif result.reachable:
            log.info("reachability: %s dialled this node back at %s", short_id(result.checked_by[-1]),
                     result.observed)
        else:
            log.warning("this node cannot be reached by other peers (%s dialled it back at %s in vain): it trains "
                        "stage 0 and starts its own pairings, and nobody routes work to it. To take any stage, %s",
                        ", ".join(short_id(p) for p in result.checked_by), ", ".join(result.failures),
                        self._open_port_advice())
            log.debug("dial-back failures: %s", result.unreachable_at())
            await self._become_client(result)

    async def _become_client(self, reachability: Reachability) -> None:
        self.reachability = reachability
        await self.dht.restart_in_client_mode()
        self.transport = Transport(await self.dht.replicate_p2p())
        await self._refresh_registry(all_stages=True)

    def _open_port_advice(self) -> str:
        ports = tcp_ports(self.dht.visible_maddrs()) or ["PORT"]
        return (f"forward TCP port {ports[0]} on your router to this machine (and open it in its firewall), then "
                f"start again with --public-ip YOUR_PUBLIC_IP --port {ports[0]}")

    # -- checkpoints -----------------------------------------------------------------
    async def _find_checkpoint(self) -> tuple[dict, dict] | None:
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return None
        found = await self.compute(latest_checkpoint, cfg.checkpoint_dir)
        if found is None:
            log.info("no checkpoint in %s yet; starting fresh", cfg.checkpoint_dir)
            return None
        meta = found[1]
        if meta.get("spec_hash") != self.spec_hash:
            raise IncompatibleRun(f"the checkpoint in {cfg.checkpoint_dir} belongs to run spec "
                                  f"{meta.get('spec_hash')}, not to this run ({self.spec_hash}); give this run its "
                                  "own --checkpoint-dir")
        stage = meta.get("stage")
        if type(stage) is not int or not 0 <= stage < self.spec.num_stages:
            raise CheckpointError(f"the checkpoint in {cfg.checkpoint_dir} names no valid stage ({stage!r})")
        if cfg.stage is not None and cfg.stage != stage:
            raise ConfigError(f"--stage {cfg.stage} conflicts with the checkpoint, which holds stage {stage}")
        return found

    async def _resume_from(self, tensors: dict, meta: dict) -> None:
        try:
            await self.compute(self.worker.load_checkpoint_state, tensors, meta)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint in {self.config.checkpoint_dir} does not fit: {exc}") from None
        self._resume_data = meta.get("data")
        self.stats.resumed_from_step = self.worker.inner_step
        log.info("resumed from checkpoint %s: inner step %d, outer round %d", f"ckpt-{meta['step']:010d}",
                 self.worker.inner_step, self.worker.outer_round)

    def _steps_behind_stage(self) -> int:
        """How far the most advanced live peer of our stage is ahead of us, in inner steps."""
        ahead = max((r.inner_step for r in self.live_peers(self.stage).values()), default=0)
        return max(0, ahead - self.worker.inner_step)

    def _checkpoint_snapshot(self) -> tuple[dict, dict]:
        """On the compute thread, so the copy is consistent with the data position."""
        tensors, meta = self.worker.checkpoint_state()
        meta.update(spec_hash=self.spec_hash, run_id=self.spec.run_id, stage=self.stage, peer_id=self.peer_id,
                    version=__version__,
                    data=None if self.loader is None else {"shard": [self.loader.shard_id, self.loader.num_shards],
                                                           **self.loader.state_dict()})
        return tensors, meta

    async def _save_checkpoint(self, why: str) -> None:
        if self.config.checkpoint_dir is None or self.worker is None:
            return
        try:
            tensors, meta = await self.compute(self._checkpoint_snapshot)
            path = await asyncio.to_thread(save_checkpoint, self.config.checkpoint_dir, meta["inner_step"], tensors,
                                           meta)
            self._last_checkpoint = path
            # one after every round is routine; the shutdown one is what a volunteer looks for
            log.log(logging.INFO if why == "on shutdown" else logging.DEBUG, "checkpoint %s written (%s)", path.name,
                    why)
        except OSError as exc:  # a full or read-only disk: keep training, say so
            log.error("could not write a checkpoint to %s: %s", self.config.checkpoint_dir, exc)

    async def _pick_stage(self) -> int:
        """Balance peers over stages, also when several join at once: announce a first
        guess, give simultaneous joiners time to announce theirs, then take this
        node's place in an assignment every joiner computes the same way. Joiners that
        did not see each other in time (records spread through the DHT in seconds, and
        on a busy machine 4 volunteers once split 3 + 1) then even out: while the
        announced stages differ by two or more, the newest id of a fullest stage moves
        to an emptiest one."""
        self.stage = self._assign_stage()
        await self._heartbeat()  # state "joining": visible to the others
        chosen = None
        for settle in range(STAGE_SETTLE_PASSES):
            await asyncio.sleep(self.config.registry_poll_s * 2 * random.uniform(1.0, 1.5))
            await self._refresh_registry(all_stages=True)
            chosen = self._assign_stage() if settle == 0 else self._rebalanced_stage()
            if chosen == self.stage and settle > 0:
                break
            if chosen != self.stage:
                log.info("taking stage %d instead of %d: other peers joined at the same time", chosen, self.stage)
                self._state = "leaving"  # withdraw the guess at once rather than at record expiry
                await self._heartbeat()
                self._state = "joining"
                self.stage = chosen
                await self._heartbeat()
        return self.stage

    def _rebalanced_stage(self) -> int:
        """Our stage, or an emptiest one when the stages as announced differ by two or
        more peers and we are the newest id of a fullest stage (nobody behind a NAT
        moves: it can only hold stage 0)."""
        stages = range(self.spec.num_stages)
        announced = {s: [p for p, r in self.peers.get(s, {}).items() if r.state in ("training", "joining")]
                     for s in stages}
        announced[self.stage].append(self.peer_id)
        count = {s: len(peers) for s, peers in announced.items()}
        if not self.reachable or max(count.values()) - min(count.values()) < 2 or count[self.stage] < max(
                count.values()):
            return self.stage
        movable = [p for p in announced[self.stage] if p == self.peer_id or (
            self.peers[self.stage][p].state == "joining" and self.peers[self.stage][p].reachable)]
        if max(movable) != self.peer_id:
            return self.stage
        return min(stages, key=lambda s: (count[s], s))

    def _assign_stage(self) -> int:
        """Joiners others cannot dial take stage 0 (it only calls out); the others, in
        peer-id order, each take the stage with the fewest peers (ties: the lower total
        throughput, then the lower index). Peers are counted rather than weighted by
        throughput because the throughputs of different stages are not comparable
        (stage 0 measures the whole pipeline's latency)."""
        if not self.reachable:
            return 0
        stages = range(self.spec.num_stages)
        count = {s: sum(r.state == "training" for r in self.peers.get(s, {}).values()) for s in stages}
        speed = {s: sum(r.throughput for r in self.peers.get(s, {}).values() if r.state == "training")
                 for s in stages}
        joining = {p: r for s in stages for p, r in self.peers.get(s, {}).items() if r.state == "joining"}
        count[0] += sum(not r.reachable for r in joining.values())
        joiners = sorted({self.peer_id, *(p for p, r in joining.items() if r.reachable)})
        for peer in joiners:
            best = min(stages, key=lambda s: (count[s], speed[s], s))
            if peer == self.peer_id:
                return best
            count[best] += 1
        raise AssertionError("not reached: this node is among the joiners")

    async def _serve(self) -> None:
        per_activation = self.spec.batch_size * self.spec.seq_len * self.worker.model_config.hidden_size * 4
        self.frame_limits = FrameLimits(max_payload_bytes=4 * per_activation + (1 << 20))
        if not self.worker.is_first:
            await self.transport.serve(protocols.FORWARD, self._handle_forward,
                                       ServeLimits(max_request_bytes=4 * per_activation + (1 << 20),
                                                   max_concurrent=self.config.max_queue,
                                                   handler_timeout_s=self.config.hop_timeout_s * 2),
                                       authorize=self._admit)
        numel = sum(p.numel() for p in self.worker.params)
        param_bytes = numel * 4
        self.outer_limits = FrameLimits(max_payload_bytes=2 * param_bytes + (1 << 20))
        exchange_timeout_s = self.config.exchange_timeout_for(
            2 * numel * WIRE_PRECISIONS[self.config.outer_wire].itemsize)  # phi and Delta
        self.pairing.request_timeout_s = exchange_timeout_s
        await self.transport.serve(protocols.OUTER, self._handle_outer,
                                   ServeLimits(max_request_bytes=2 * param_bytes + (1 << 20), max_concurrent=4,
                                               max_per_peer=1, handler_timeout_s=exchange_timeout_s),
                                   authorize=self._admit)
        await self.transport.serve(protocols.PAIR, self._handle_propose,
                                   ServeLimits(max_request_bytes=PROPOSAL_MAX_BYTES, max_concurrent=8, max_per_peer=1,
                                               handler_timeout_s=PROPOSE_TIMEOUT_S),
                                   authorize=self._admit)
        await self.transport.serve(protocols.STATUS, partial(handle_status_request, self),
                                   ServeLimits(max_request_bytes=1024, max_concurrent=8, max_per_peer=2,
                                               handler_timeout_s=5.0),
                                   authorize=self._admit)
        if self.reachable:  # a client behind a NAT gets no inbound streams to answer anyway
            await serve_dialback(self.transport, authorize=self._admit, on_fault=self._peer_fault)
        await self.transport.serve(protocols.STATE, self.state_sync.handle,
                                   ServeLimits(max_request_bytes=64 << 10, max_concurrent=4, max_per_peer=1,
                                               handler_timeout_s=self.config.state_download_timeout_s),
                                   authorize=self._admit)

    async def _shutdown(self) -> None:
        """Every step is bounded: a dead daemon or DHT process must not hang the exit."""
        self._state = "leaving"
        if self.transport is not None:
            for name in (protocols.FORWARD, protocols.PAIR, protocols.OUTER, protocols.STATE, protocols.STATUS,
                         DIALBACK):
                await _bounded(self.transport.stop_serving(name), 3.0, f"removing the {name} handler")
        if self.dht is not None and self.stage is not None and self.dht.is_alive():
            # a `leaving` record: peers stop routing to us at once instead of at record expiry
            await _bounded(self._heartbeat(), 3.0, "publishing the leaving record")
        if self.worker is not None and self.status == "finished":  # a clean stop, not a failed start
            # bounded: a wedged compute thread must not keep SIGTERM from stopping the node
            await _bounded(self._save_checkpoint("on shutdown"), 60.0, "writing the shutdown checkpoint")
        self._write_outputs()
        if self.metrics is not None:
            self._log_metrics()
            self.metrics.close()
        if self.transport is not None:
            await _bounded(self.transport.p2p.shutdown(), 5.0, "closing the p2p client")
        if self.dht is not None:
            await _bounded(self.dht.shutdown(), 15.0, "stopping the DHT")
        if self.status_pages is not None:
            await _bounded(self.status_pages.close(), 3.0, "closing the status endpoints")
        self._compute_closed = True
        self._compute.shutdown(wait=True, cancel_futures=True)
        if self.worker is not None and self.status == "finished":
            log.info("%s", self._how_to_resume())

    def _how_to_resume(self) -> str:
        """The last line a volunteer sees: where its progress is, and what to type to go on."""
        done = f"stopped at inner step {self.worker.inner_step} (outer round {self.worker.outer_round})"
        command = " ".join(shlex.quote(arg) for arg in self.config.command_line) or "swarm-node join ..."
        if self._last_checkpoint is None:
            return (f"{done}; nothing was saved. To resume next time, start with --checkpoint-dir DIR "
                    f"--identity FILE: {command} --checkpoint-dir DIR --identity FILE")
        keep_id = "" if self.config.identity_path else " (add --identity FILE to keep this peer id next time)"
        return f"{done}; checkpoint {self._last_checkpoint}. Resume with: {command}{keep_id}"

    def _open_metrics(self) -> None:
        cfg = self.config
        if not cfg.metrics_sinks:
            return
        directory = cfg.metrics_dir or cfg.run_dir or Path("runs") / self.spec.run_id
        tag = f"stage{self.stage}-{self.peer_id[-8:]}"
        self.metrics = open_sinks(cfg.metrics_sinks, directory, run_name=tag, project=self.spec.run_id,
                                  config={"spec": self.spec.to_dict(), "stage": self.stage, "peer_id": self.peer_id})
        log.info("metrics (%s) go to %s", ", ".join(cfg.metrics_sinks), directory)

    def _log_metrics(self) -> None:
        if self.metrics is None or self.worker is None or self.transport is None:
            return
        w, stats = self.worker, self.stats
        values = {"outer_round": w.outer_round, "throughput_samples_per_s": self._throughput,
                  "tokens": stats.tokens, "microbatches_done": stats.microbatches_done,
                  "microbatches_lost": stats.microbatches_lost, "retries": stats.retries,
                  "rounds_with_partner": stats.rounds_with_partner, "local_only_rounds": stats.local_only_rounds,
                  "bytes_sent": self.transport.bytes_sent, "bytes_received": self.transport.bytes_received,
                  "streams_served": self.transport.streams_served}
        if w.loss_ema is not None:
            values["train_loss"] = w.loss_ema
        self.metrics.log(w.inner_step, values)

    def _write_outputs(self) -> None:
        run_dir = self.config.run_dir
        if run_dir is None or self.worker is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        tag = f"stage{self.stage}-{self.peer_id[-8:]}"
        torch.save({k: v.detach().cpu() for k, v in self.worker.stage.state_dict().items()},
                   run_dir / f"weights-{tag}.pt.tmp")
        os.replace(run_dir / f"weights-{tag}.pt.tmp", run_dir / f"weights-{tag}.pt")
        summary = self.summary()
        summary["weights_file"] = f"weights-{tag}.pt"
        (run_dir / f"summary-{tag}.json.tmp").write_text(json.dumps(summary, indent=2))
        os.replace(run_dir / f"summary-{tag}.json.tmp", run_dir / f"summary-{tag}.json")

    def summary(self) -> dict:
        w = self.worker
        return {
            "peer_id": self.peer_id, "stage": self.stage, "pid": os.getpid(), "status": self.status,
            "inner_steps": w.inner_step if w else 0, "outer_rounds": w.outer_round if w else 0,
            "bytes_sent": self.transport.bytes_sent if self.transport else 0,
            "bytes_received": self.transport.bytes_received if self.transport else 0,
            "spec_hash": self.spec_hash, "final_theta_digest": w.theta_digest() if w else None,
            **asdict(self.stats),
        }

    # -- registry ------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        if not self.dht.is_alive():
            raise SwarmError("the DHT process died, so this node can no longer find peers; "
                             "restart it (if the machine is short of memory, that is the likely cause)")
        try:
            async with asyncio.timeout(self.config.heartbeat_s * 2):
                await publish_record(self.dht, self.spec.run_id, self._record(), ttl_s=self.config.record_ttl_s)
        except TimeoutError:
            log.warning("registry heartbeat timed out")

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s * random.uniform(0.8, 1.2))
            await self._heartbeat()

    async def _publish_loop(self) -> None:
        """Every node re-publishes the spec it follows, signed, so the run can be joined
        through any of its nodes, also once every bootstrap peer is gone."""
        while True:
            await asyncio.sleep(SPEC_REPUBLISH_S * random.uniform(0.8, 1.2))
            await _bounded(publish_spec(self.dht, self.spec), 10.0, "re-publishing the run spec")

    async def _connectivity_loop(self) -> None:
        """Remember whom we were connected to; when every connection is gone (a network
        blip, or every peer we knew restarted), dial the initial and remembered peers.
        Initial peers we are not connected to are dialled again too, with a back-off: a
        bootstrap that restarts has forgotten the swarm, and the DHT forgot it when its
        calls failed; dialling it puts each of us back in its routing table."""
        alone_checks = 0
        redial = Backoff(self.config.connectivity_check_s, MAX_REDIAL_S)
        initial = dict(zip(peer_ids_of(self.config.initial_peers), self.config.initial_peers))
        initial.pop(self.peer_id, None)
        while True:
            await asyncio.sleep(self.config.connectivity_check_s * random.uniform(0.8, 1.2))
            try:
                async with asyncio.timeout(5.0):
                    connected = await self.dht.connected_peers()
            except (TimeoutError, PeerError) as exc:
                log.debug("could not list connections: %s", exc)
                continue
            for peer, addrs in connected.items():
                self._known_peers.pop(peer, None)
                self._known_peers[peer] = addrs[:4]
                while len(self._known_peers) > MAX_KNOWN_PEERS:
                    self._known_peers.pop(next(iter(self._known_peers)))
            alone_checks = 0 if connected else alone_checks + 1
            if alone_checks >= 2:
                await self._rebootstrap()
                continue
            missing = [maddr for peer, maddr in initial.items() if peer not in connected]
            if connected and missing and redial.due():  # alone, the re-bootstrap above dials them
                reached = await self._redial(missing)
                if reached and redial.failures:  # it was down: worth a line
                    log.info("reconnected to %d initial peer(s) after %d failed attempts", reached, redial.failures)
                redial.done(success=reached > 0)

    async def _redial(self, maddrs: list[str]) -> int:
        try:
            return await self.dht.rebootstrap(maddrs, timeout_s=5.0)
        except (TimeoutError, PeerError) as exc:
            log.debug("re-dialling initial peers failed: %s", exc)
            return 0

    async def _rebootstrap(self) -> None:
        initial_ids = set(peer_ids_of(self.config.initial_peers))
        known = [f"{addr}/p2p/{peer}" for peer, addrs in self._known_peers.items() for addr in addrs
                 if "/p2p/" not in addr and peer not in initial_ids]
        log.warning("no connection to any peer; re-bootstrapping from %d initial and %d known peers",
                    len(self.config.initial_peers), len(self._known_peers))
        try:
            reached = await self.dht.rebootstrap([*self.config.initial_peers, *known])
        except (TimeoutError, PeerError) as exc:
            reached = 0
            log.debug("re-bootstrap failed: %s", exc)
        if reached:
            log.info("re-bootstrap: reconnected to %d peers", reached)
        else:
            self._note_failure("no peer reachable; re-bootstrapping")
            log.warning("re-bootstrap: nobody answered; trying again in %.0fs (check this machine's network)",
                        self.config.connectivity_check_s)

    async def _registry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.registry_poll_s * random.uniform(0.8, 1.2))
            try:
                async with asyncio.timeout(max(2.0, self.config.registry_poll_s * 2)):
                    await self._refresh_registry()
            except TimeoutError:
                log.warning("registry read timed out")
            if not self.reachable:
                await self._meet_a_seeking_peer()

    async def _meet_a_seeking_peer(self) -> None:
        """Nobody can call a node behind a NAT, so nobody can pull its round forward the
        way a proposal does (see _maybe_round_early). It looks instead: a reachable peer
        of its stage that announces ``seeking`` is waiting for a partner right now, and if
        we are past half of our round we take ours early and propose."""
        if (isinstance(self.pairing, PairingCoordinator) and self.pairing.state.value == "idle"
                and any(r.seeking for r in self.callable_peers(self.stage).values())):
            await self._maybe_round_early(wait_s=0.0)
    async def _refresh_registry(self, all_stages: bool = False) -> None:
        if all_stages or self.stage is None:
            stages = range(self.spec.num_stages)
        else:
            stages = {self.stage, min(self.stage + 1, self.spec.num_stages - 1)}
        for stage in stages:
            parsed, unreadable = await read_stage(self.dht, self.spec.run_id, stage)
            for peer, exc in unreadable.items():
                self._ignore_once(peer, f"unreadable registry record ({exc})")
            records = {}
            for peer, record in parsed.items():
                if peer == self.peer_id:
                    continue
                if not self.spec.admits(peer):
                    self._ignore_once(peer, "not on this closed run's list of allowed peers")
                    continue
                if record.spec_hash != self.spec_hash:
                    self._ignore_once(peer, f"run-spec hash {record.spec_hash} differs from ours ({self.spec_hash})")
                    continue
                if record.stage == stage:
                    records[peer] = record
            self.peers[stage] = records

    def _ignore_once(self, peer: str, why: str) -> None:
        if peer not in self._ignored_peers:
            if len(self._ignored_peers) >= MAX_TRACKED_PEERS:
                self._ignored_peers.clear()  # bounded: at worst a peer gets logged a second time
            self._ignored_peers.add(peer)
            log.warning("ignoring peer %s: %s", short_id(peer), why)

    def _peer_fault(self, peer: str, why: str) -> None:
        """A caller sent something malformed: log it once, and after repeated faults
        stop serving it for a while (its streams are then closed unread)."""
        self._ignore_once(peer, why)
        count = self._faults.pop(peer, 0) + 1
        if count >= self.config.max_peer_faults:
            self._caller_bans[peer] = time.monotonic() + self.config.caller_ban_s
            log.warning("banning peer %s for %.0f s after %d bad requests", short_id(peer),
                        self.config.caller_ban_s, count)
            count = 0
        self._faults[peer] = count
        while len(self._faults) > MAX_TRACKED_PEERS:
            self._faults.pop(next(iter(self._faults)))

    def _admit(self, peer: str) -> bool:
        """Stream handlers' gate: on a closed run's list, and not banned for faults."""
        until = self._caller_bans.get(peer)
        if until is not None and time.monotonic() >= until:
            del self._caller_bans[peer]
            until = None
        return until is None and self.spec.admits(peer)

    def live_peers(self, stage: int) -> dict[str, PeerRecord]:
        return {p: r for p, r in self.peers.get(stage, {}).items() if r.state == "training"}

    def callable_peers(self, stage: int) -> dict[str, PeerRecord]:
        """Live peers we can open streams to: routing, pairing proposals and state
        downloads go only there (a peer behind a NAT calls out, and is never called)."""
        return {p: r for p, r in self.live_peers(stage).items() if r.reachable}

    # -- what the volunteer sees ------------------------------------------------------
    async def _progress_loop(self) -> None:
        progress = NodeProgress(log, live=self._live_progress())
        try:
            while True:
                await asyncio.sleep(progress.period_s)
                progress.show(self._snapshot())
        finally:
            progress.close()

    def _live_progress(self) -> bool:
        return self.config.progress and sys.stderr.isatty()

    def _snapshot(self) -> NodeSnapshot:
        w = self.worker
        tokens_per_microbatch = self.spec.batch_size * self.spec.seq_len
        grown, span_s = self._token_rate.sample_rate(self.stats.microbatches_done)
        last = self._last_round
        recent = self._recent_microbatches.sample(self.stats.microbatches_done)
        return NodeSnapshot(
            inner_step=w.inner_step, max_steps=self.config.max_steps,
            loss=w.loss_ema if w.is_last else self._loss_seen,
            tokens_per_s=grown * tokens_per_microbatch / span_s if span_s > 0 else 0.0,
            stage=self.stage, num_stages=self.spec.num_stages, peers_in_stage=len(self.live_peers(self.stage)),
            last_round=last[0] if last else None, last_partner=last[1] if last else None,
            last_round_ago_s=time.monotonic() - last[2] if last else None,
            stalled=None if recent else self._last_error or self._waiting_for())

    def _waiting_for(self) -> str:
        if self.worker.is_first and not self.worker.is_last:
            return f"no micro-batch came back from stage {self.stage + 1} in the last minute"
        return f"no work from stage {self.stage - 1} in the last minute" if self.stage else "nothing done"

    def _note_loss(self, loss: float) -> None:
        self._loss_seen = loss if self._loss_seen is None else 0.95 * self._loss_seen + 0.05 * loss

    # -- the data path -------------------------------------------------------------
    async def _producer_loop(self) -> None:
        """Stage 0: keep up to max_in_flight micro-batches in the pipeline."""
        resumed = self._resume_data
        if self.config.data_shard is None and resumed is not None:
            shard_id, num_shards = resumed["shard"]  # the shard this node read before its restart
        else:
            shard_id, num_shards = self.config.data_shard or (_shard_of(self.peer_id, 1024), 1024)
        num_shards = min(num_shards, max(1, self.data.num_train_windows // self.spec.batch_size))
        loader = ShardedBatches(self.data, batch_size=self.spec.batch_size, seed=self.spec.seed,
                                shard_id=shard_id % num_shards, num_shards=num_shards)
        if resumed is not None and [loader.shard_id, loader.num_shards] == list(resumed["shard"]):
            loader.load_state_dict(resumed)
        self.loader = loader
        slots = asyncio.Semaphore(self.config.max_in_flight)
        # Micro-batches that finish during an outer round merge into one step, so after
        # draining the pipeline top up until the step count is really reached.
        while not self._reached_max_steps():
            async with asyncio.TaskGroup() as tg:
                while not self._done():
                    await self._round_idle.wait()
                    await slots.acquire()
                    if self._done():
                        slots.release()
                        break
                    inputs, targets = await self.compute(loader.next_batch)
                    self._in_flight += 1
                    tg.create_task(self._run_microbatch(inputs, targets, slots))
            await self._round_idle.wait()
            if not self._reached_max_steps():
                # Gradients owed to the last steps wait for the step after a round. Take it
                # here, on the compute thread: looping back without awaiting anything would
                # spin on the event loop and starve the round that is meant to take it.
                await self._after_accumulate()
        log.info("node %s finished %d inner steps", short_id(self.peer_id), self.worker.inner_step)
        self._state = "finished"
        await self._heartbeat()
        await self._round_idle.wait()  # a round still open finishes before we leave
        self.stop()

    def _reached_max_steps(self) -> bool:
        limit = self.config.max_steps
        return self._stop.is_set() or (limit is not None and self.worker.inner_step >= limit)

    def _done(self) -> bool:
        """Stage 0 has issued enough micro-batches for max_steps, counting those in flight
        and gradients that arrived during an outer round and wait for the step after it."""
        limit = self.config.max_steps
        if limit is None:
            return self._stop.is_set()
        samples = self._in_flight * self.spec.batch_size + self.worker.pending_samples
        return self.worker.inner_step + samples / self.spec.samples_per_step >= limit

    async def _run_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor, slots: asyncio.Semaphore) -> None:
        try:
            started = time.perf_counter()
            if self.worker.is_last:  # a single-stage run
                _, _, due = await self.compute(_last_stage_step, self.worker, None, targets, inputs)
            else:
                hidden = await self.compute(self.worker.forward, inputs)
                try:
                    grad, loss = await self._send_downstream(hidden, targets, self.config.hop_timeout_s)
                    self._note_loss(loss)
                except (PeerError, NotEnoughPeers, TimeoutError) as exc:
                    self.stats.microbatches_lost += 1
                    self._note_failure(f"micro-batch lost: {exc}")
                    log.info("micro-batch lost: %s", exc)
                    return
                _, due = await self.compute(_backward_step, self.worker, inputs, grad)
            self._throughput = throughput_ema(self._throughput, len(inputs), time.perf_counter() - started)
            self.stats.microbatches_done += 1
            self.stats.tokens += inputs.numel()
            self._note_round_due(due)
        finally:
            self._in_flight -= 1
            slots.release()

    async def _send_downstream(self, hidden: torch.Tensor, targets: torch.Tensor,
                               timeout_s: float) -> tuple[torch.Tensor, float]:
        """Send activations to a next-stage peer; returns (grad wrt hidden, loss).
        Retries other peers on failure, banning the failed one."""
        next_stage = self.stage + 1
        deadline = time.monotonic() + timeout_s
        payload = await self.compute(encode_frame, {"kind": "fwd", "spec": self.spec_hash,
                                                    "deadline_s": timeout_s},
                                     [hidden.to(WIRE_PRECISIONS[self.config.activation_wire]), targets.to(torch.int32)])
        tried: set[str] = set()
        attempts = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or attempts > self.config.hop_retries:
                raise NotEnoughPeers(f"no stage-{next_stage} peer completed the micro-batch "
                                     f"after {attempts} attempts")
            candidates = [Candidate(p, r.throughput, r.queue) for p, r in self.callable_peers(next_stage).items()]
            peer = self.chooser.choose(candidates, exclude=tried)
            if peer is None:
                await asyncio.sleep(min(0.5, remaining))  # the registry loop may show someone by then
                tried.clear()
                continue
            attempts += 1
            if attempts > 1:
                self.stats.retries += 1
            self.chooser.started(peer)
            try:
                raw = await self.transport.request(peer, protocols.FORWARD, payload, timeout_s=remaining,
                                                   max_response_bytes=len(payload) + (1 << 16))
                grad, loss, rms = await self.compute(_decode_gradient, raw, self.frame_limits, hidden.shape)
                problem = self._gradient_screen.check(rms, "gradient RMS")
                if problem:
                    raise ProtocolError(problem)
                self.chooser.report_success(peer)
                self._streams_closed.pop(peer, None)
                return grad, loss
            except PeerRefused as exc:
                tried.add(peer)
                log.debug("stage-%d peer %s refused: %s", next_stage, short_id(peer), exc)
            except StreamClosed as exc:
                tried.add(peer)
                if self._note_stream_closed(peer):  # twice in a row: it refuses us, or is unwell
                    ban = self.chooser.report_failure(peer)
                    self._note_failure(f"stage-{next_stage} peer {short_id(peer)} failed: {exc}")
                    log.info("stage-%d peer %s failed (%s, twice in a row); banned for %.0fs", next_stage,
                             short_id(peer), exc, ban)
                else:  # once: a reset inside the daemons, retried at once
                    log.debug("stage-%d peer %s: %s; retrying", next_stage, short_id(peer), exc)
            except PeerError as exc:
                tried.add(peer)
                ban = self.chooser.report_failure(peer)
                self._note_failure(f"stage-{next_stage} peer {short_id(peer)} failed: {exc}")
                log.info("stage-%d peer %s failed (%s); banned for %.0fs", next_stage, short_id(peer), exc, ban)
            finally:
                self.chooser.finished(peer)

    def _note_stream_closed(self, peer: str) -> bool:
        """Count a stream that ended before its answer; True from the second in a row."""
        count = self._streams_closed.pop(peer, 0) + 1
        self._streams_closed[peer] = count
        while len(self._streams_closed) > MAX_TRACKED_PEERS:
            self._streams_closed.pop(next(iter(self._streams_closed)))
        return count >= 2

    async def _handle_forward(self, remote: str, request: bytes) -> bytes:
        """Activations + targets in; gradient wrt those activations + loss out."""
        if self._stop.is_set() or self._queue >= self.config.max_queue:
            return encode_frame({"ok": False, "error": "busy"})
        self._queue += 1
        try:
            header, hidden, targets = await self.compute(self._decode_forward, request)
            started = time.perf_counter()
            budget = min(float(header.get("deadline_s", self.config.hop_timeout_s)), self.config.hop_timeout_s)
            if self.worker.is_last:
                loss, grad, due = await self.compute(_last_stage_step, self.worker, hidden, targets)
            else:
                out = await self.compute(self.worker.forward, hidden)
                grad_out, loss = await self._send_downstream(out, targets, budget * 0.9)
                self._note_loss(loss)
                grad, due = await self.compute(_backward_step, self.worker, hidden, grad_out)
            self._throughput = throughput_ema(self._throughput, len(hidden), time.perf_counter() - started)
            self.stats.microbatches_done += 1
            self._note_round_due(due)
            return await self.compute(encode_frame, {"ok": True, "loss": loss},
                                      [grad.to(WIRE_PRECISIONS[self.config.activation_wire])])
        except ProtocolError as exc:
            self._peer_fault(remote, f"bad forward request ({exc})")
            return encode_frame({"ok": False, "error": f"protocol: {exc}"[:200]})
        except (PeerError, NotEnoughPeers, TimeoutError) as exc:
            self.stats.microbatches_lost += 1
            return encode_frame({"ok": False, "error": f"downstream: {exc}"[:200]})
        finally:
            self._queue -= 1

    def _decode_forward(self, request: bytes) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """On the compute thread: parse a forward request and check it fits this stage."""
        header, tensors = decode_frame(request, self.frame_limits)
        if header.get("kind") != "fwd" or header.get("spec") != self.spec_hash:
            raise ProtocolError("not a forward request of this run")
        deadline = header.get("deadline_s", self.config.hop_timeout_s)
        if type(deadline) not in (int, float) or not 0 < deadline <= 3600:
            raise ProtocolError(f"bad deadline {deadline!r}")
        if len(tensors) != 2:
            raise ProtocolError("forward request needs activations and targets")
        hidden, targets = tensors
        batch, seq = targets.shape if targets.dim() == 2 else (-1, -1)
        hidden_size = self.worker.model_config.hidden_size
        if (hidden.shape != (batch, seq, hidden_size) or not 0 < batch <= 4 * self.spec.batch_size
                or not 0 < seq <= self.spec.seq_len or not hidden.is_floating_point()
                or targets.dtype not in (torch.int32, torch.int64)):
            raise ProtocolError(f"shapes {tuple(hidden.shape)}/{tuple(targets.shape)} do not fit this stage")
        if not finite(hidden):
            raise ProtocolError("non-finite activations")
        problem = self._activation_screen.check(_rms(hidden), "activation RMS")
        if problem:
            raise ProtocolError(problem)
        if int(targets.min()) < 0 or int(targets.max()) >= self.worker.model_config.vocab_size:
            raise ProtocolError("target ids out of the vocabulary")
        return header, hidden.float(), targets.long()

    async def _after_accumulate(self) -> None:
        _, due = await self.compute(_maybe_step, self.worker)
        self._note_round_due(due)

    def _note_round_due(self, due: bool) -> None:
        if due and self._round_idle.is_set():
            self._round_idle.clear()
            self._round_due.set()

    # -- outer rounds --------------------------------------------------------------
    async def _outer_loop(self) -> None:
        if self.worker.slow is None:
            return
        while True:
            await self._round_due.wait()
            self._round_due.clear()
            try:
                await self._outer_round()
            finally:
                self._round_idle.set()
            self._log_metrics()
            if self.worker.outer_round % self.config.checkpoint_every_rounds == 0:
                await self._save_checkpoint(f"after round {self.worker.outer_round - 1}")
            # gradients that arrived during the round may complete a step now
            await self._after_accumulate()

    async def _outer_round(self) -> None:
        round_no = self.worker.outer_round
        own = await self.compute(self.worker.outer_payload, self.config.outer_wire)
        self._note_own_progress(await self.compute(_norm, own[1]))
        header = {"kind": "outer", "spec": self.spec_hash, "round": round_no, "ok": True}
        self._outer_reply = await self.compute(encode_frame, header, own[0] + own[1])
        announce = asyncio.create_task(self._announce_seeking())
        try:
            await self._seek_partners(round_no, own)
        finally:
            announce.cancel()  # the round may end before the record is out: the heartbeat below follows
            await asyncio.gather(announce, return_exceptions=True)
        await self._heartbeat()

    async def _announce_seeking(self) -> None:
        """Publish our record as soon as the round is open, so that peers choosing a
        partner prefer us now rather than at the next heartbeat."""
        await self.pairing.seeking.wait()
        await self._heartbeat()

    async def _seek_partners(self, round_no: int, own) -> None:
        started = time.monotonic()
        live = lambda: [p for p in self.callable_peers(self.stage) if not self.chooser.is_banned(p)]  # noqa: E731
        # Peers others cannot dial only ever call us: keep the round open for them.
        callers = any(not r.reachable and not self.chooser.is_banned(p) for p, r in self.live_peers(self.stage).items())
        had_company = callers or bool(live())
        expect_request = self._round_requested or callers
        if isinstance(self.pairing, GroupRound):
            gathered = await self.pairing.run_round(round_no, self._outer_reply, members=live,
                                                    send=self._send_outer, on_peer_failure=self.chooser.report_failure,
                                                    expect_request=expect_request)
            partners = list(gathered)
            others = list(gathered.values())
        else:
            result: PairResult | None = await self.pairing.run_round(
                round_no, self._outer_reply,
                candidates=lambda: [(p, self.peers[self.stage][p].seeking) for p in live()],
                propose=self._send_proposal, send=self._send_outer, on_peer_failure=self.chooser.report_failure,
                expect_request=expect_request)
            partners = [result.partner] if result else []
            others = [result.payload] if result else []
        self._outer_reply = None
        self._round_requested = False
        await self.compute(self.worker.apply_outer, own, others)
        self._last_round = (round_no, short_id(partners[0]) if partners else None, time.monotonic())
        if not others:
            self.stats.local_only_rounds += 1
            if had_company:  # alone in the stage, a local-only round is the plan, not a failure
                self._note_failure(f"round {round_no}: no partner, local-only step")
                log.info("round %d: no partner found in %.1fs, local-only step", round_no,
                         time.monotonic() - started)
            else:
                log.info("round %d: no other peer in stage %d, local-only step", round_no, self.stage)
        else:
            self.stats.rounds_with_partner += 1
            self.stats.partners.extend(partners)
            log.info("round %d: averaged with %s in %.2fs", round_no, ", ".join(short_id(p) for p in partners),
                     time.monotonic() - started)

    async def _maybe_round_early(self, wait_s: float) -> None:
        """A partner is at its boundary and we are past half of our round: start our
        round now (steps stop at once), and let the request in when we are seeking
        (within ``wait_s``: the caller's deadline must leave room for our answer)."""
        if not self._round_idle.is_set() or self._stop.is_set():
            return
        if not await self.compute(_force_round_if_ready, self.worker):
            return
        self._round_requested = True
        self._round_idle.clear()
        self._round_due.set()
        try:
            async with asyncio.timeout(wait_s):
                await self.pairing.seeking.wait()
        except TimeoutError:
            pass

    async def _send_proposal(self, peer: str, timeout_s: float) -> None:
        request = encode_frame({"kind": "propose", "spec": self.spec_hash, "round": self.worker.outer_round})
        raw = await self.transport.request(peer, protocols.PAIR, request, timeout_s=timeout_s,
                                           max_response_bytes=PROPOSAL_MAX_BYTES)
        header, _ = decode_frame(raw, PROPOSAL_LIMITS)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused"))[:200])

    async def _handle_propose(self, remote: str, request: bytes) -> bytes:
        """A peer of our stage asks to pair this round: a few bytes, so a refusal is cheap."""
        try:
            header, tensors = decode_frame(request, PROPOSAL_LIMITS)
            if header.get("kind") != "propose" or header.get("spec") != self.spec_hash or tensors:
                raise ProtocolError("not a pairing proposal of this run")
            if not isinstance(self.pairing, PairingCoordinator):
                raise Refused("not-pairing")  # a DiLoCo run exchanges with everyone, no proposals
            if self.chooser.is_banned(remote):  # it failed us or sent a poisoned update: we do not pair with it either
                raise Refused("busy")
            if self.pairing.state.value == "idle":
                await self._maybe_round_early(wait_s=PROPOSE_TIMEOUT_S / 2)  # else: not-ready, not a time-out
            self.pairing.on_propose(remote)
            return encode_frame({"kind": "propose", "ok": True})
        except Refused as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError as exc:
            self._peer_fault(remote, f"bad pairing proposal ({exc})")
            return encode_frame({"ok": False, "error": "protocol"})

    async def _send_outer(self, peer: str, payload: bytes, timeout_s: float):
        raw = await self.transport.request(peer, protocols.OUTER, payload, timeout_s=timeout_s,
                                           max_response_bytes=self.outer_limits.max_payload_bytes + (1 << 16))
        header, tensors = await self.compute(decode_frame, raw, self.outer_limits)
        if not header.get("ok"):
            raise Refused(str(header.get("error", "refused")))
        return await self._check_outer(header, tensors)

    def _note_own_progress(self, delta_norm: float) -> None:
        """Our own Delta norm is the scale a partner's Delta and phi distance are held to."""
        self._delta_screen.note(delta_norm)
        self._distance_screen.note(delta_norm)

    async def _check_outer(self, header: dict, tensors: list[torch.Tensor]):
        if header.get("kind") != "outer" or header.get("spec") != self.spec_hash:
            raise ProtocolError("not an outer exchange of this run")
        problem = await self.compute(self.worker.check_partner_tensors, tensors)
        if problem:
            raise ProtocolError(problem)
        n = len(self.worker.params)
        phi, delta = tensors[:n], tensors[n:]
        delta_norm, distance = await self.compute(_partner_magnitudes, self.worker, phi, delta)
        if self._delta_screen.reference() is None:
            # Before our first round the only scale we have is our progress so far, and a
            # partner a round ahead of a node in warm-up (or started late) is out of it
            # honestly: decline such an exchange, do not punish. The screens start from
            # our first full round's Delta norm (see _outer_round).
            own = MagnitudeScreen(self.config.max_update_ratio)
            own.note(await self.compute(lambda: _norm(self.worker.slow.deltas())))
            problem = (own.check_only(delta_norm, "partner's Delta norm")
                       or own.check_only(distance, "partner's distance from our phi"))
            if problem:
                log.info("declining an outer exchange before our first round: %s", problem)
                raise Refused(f"not-ready ({problem})")
        else:
            # Distances only compare with our own Delta norms: right after init or an
            # exchange honest partners sit almost on top of each other, and a median of
            # such distances would make the next honest partner look like an attack.
            problem = (self._delta_screen.check(delta_norm, "partner's Delta norm")
                       or self._distance_screen.check_only(distance, "partner's distance from our phi"))
            if problem:  # a poisoned or broken update: the round goes on without it, the sender is banned
                raise ProtocolError(problem)
        return phi, delta

    async def _handle_outer(self, remote: str, request: bytes) -> bytes:
        async def partner_payload():
            header, tensors = await self.compute(decode_frame, request, self.outer_limits)
            return await self._check_outer(header, tensors)

        pairing = self.pairing
        try:
            if isinstance(pairing, PairingCoordinator):  # only the peer whose proposal we accepted gets in
                return await pairing.answer(remote, partner_payload)
            payload = await partner_payload()
            if pairing.state.value == "idle":
                await self._maybe_round_early(wait_s=5.0)
            return pairing.on_request(remote, payload)
        except (Refused, PeerRefused) as exc:
            return encode_frame({"ok": False, "error": str(exc)})
        except ProtocolError as exc:
            self._peer_fault(remote, f"bad outer exchange ({exc})")
            self.chooser.report_failure(remote)
            return encode_frame({"ok": False, "error": "protocol"})

class Backoff:
    """Attempts spaced ``first_s``, then twice as far each failure, at most ``max_s``."""

    def __init__(self, first_s: float, max_s: float, clock=time.monotonic):
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self.interval_s = first_s
        self.next_at = 0.0
        self.failures = 0  # in a row

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def done(self, success: bool) -> None:
        self.failures = 0 if success else self.failures + 1
        self.interval_s = self.first_s if success else min(self.max_s, 2 * self.interval_s)
        self.next_at = self.clock() + self.interval_s


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


def _rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt()) if t.numel() else 0.0


def _partner_magnitudes(worker: StageWorker, phi: list[torch.Tensor], delta: list[torch.Tensor]) -> tuple[float, float]:
    """On the compute thread: the norm of a partner's Delta and its phi's distance from ours."""
    # the partner's tensors were decoded on the CPU; ours live on the training device
    distance = math.sqrt(sum(float((p.to(own.device, torch.float32) - own).pow(2).sum())
                             for p, own in zip(phi, worker.slow.phi)))
    return _norm(delta), distance


def _decode_gradient(raw: bytes, limits: FrameLimits, shape: torch.Size) -> tuple[torch.Tensor, float, float]:
    """On the compute thread: a downstream answer, checked against the activations sent."""
    header, tensors = decode_frame(raw, limits)
    if not header.get("ok"):
        raise PeerRefused(str(header.get("error", "refused"))[:200])
    if len(tensors) != 1 or tensors[0].shape != shape or not tensors[0].is_floating_point():
        raise ProtocolError("gradient does not match the activations sent")
    grad = tensors[0].float()
    if not finite(grad):
        raise ProtocolError("non-finite gradient")
    loss = header.get("loss")
    if type(loss) not in (int, float) or not math.isfinite(loss):
        raise ProtocolError(f"bad loss {str(loss)[:40]!r}")
    return grad, float(loss), _rms(grad)


async def _bounded(awaitable, timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await awaitable
    except TimeoutError:
        log.warning("gave up %s after %.0fs", what, timeout_s)
    except (SwarmError, OSError, ConnectionError) as exc:
        log.debug("%s failed: %s", what, exc)


def _last_stage_step(worker: StageWorker, hidden, targets, token_inputs=None):
    """On the compute thread: loss, backward and (when due) the inner step, as one unit."""
    loss, grad = worker.forward_backward_last(hidden, targets, token_inputs)
    _, due = _maybe_step(worker)
    return loss, grad, due


def _backward_step(worker: StageWorker, inputs, grad_output):
    grad = worker.backward(inputs, grad_output)
    _, due = _maybe_step(worker)
    return grad, due


def _force_round_if_ready(worker: StageWorker) -> bool:
    if worker.outer_round_due() or not worker.can_round_early():
        return False
    worker.force_round()
    return True


def _maybe_step(worker: StageWorker) -> tuple[bool, bool]:
    """On the compute thread: step if enough samples are in and no outer round is
    pending; report whether a round is now due. Checking both in one call keeps two
    queued calls from stepping past a round boundary."""
    stepped = False
    if not worker.outer_round_due() and worker.ready_to_step():
        worker.step()
        stepped = True
    return stepped, worker.outer_round_due()


def _shard_of(peer_id: str, num_shards: int) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "little") % num_shards

