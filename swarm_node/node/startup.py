"""A node's start-up, in order: the status pages, the DHT, the transport (and its direct
lanes), the run's spec, the membership view and our reachability (a node nobody can
dial goes client-only), the data, the checkpoint to resume, our stage, the worker, the
components wired to each other (``_build_components``), the state to catch up on, the
handlers served, and the first heartbeat; and, for stage 0, the wait for the peers
started with it. Each step fails with one line saying what to change.

What it owns: how the pieces are built and wired, once. The node's run loop, its
rounds and its shutdown are node/conductor.py's (``Node``, which is a NodeStartup)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from swarm_node.data.source import RunData
from swarm_node.errors import ConfigError, IncompatibleRun, SwarmError
from swarm_node.gossip.exchange import ExchangeTimes, OuterExchange
from swarm_node.membership.reachability import check_own_reachability, open_port_advice
from swarm_node.membership.view import Membership
from swarm_node.net import protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.dialback import ordered_for_others, serve_dialback
from swarm_node.net.lanes import lane_hosts
from swarm_node.net.transport import ServeLimits, Transport, short_id
from swarm_node.node_services import NodeServices
from swarm_node.obs.endpoints import NodeStatus, handle_status_request
from swarm_node.spec_record import find_run_spec, peer_ids_of, publish_spec, require_version
from swarm_node.state.keeper import Checkpoints
from swarm_node.state.sync import StateSync
from swarm_node.state.witnesses import Witnesses
from swarm_node.system import raise_open_file_limit
from swarm_node.train.compiled import compile_stage
from swarm_node.train.device import explain_run_oom
from swarm_node.train.pipeline import Pipeline
from swarm_node.train.worker import StageWorker

log = logging.getLogger("swarm_node.node")


class NodeStartup:
    """The start-up half of ``Node`` (node/conductor.py): the methods that build and
    wire its components, on the attributes ``Node.__init__`` sets."""

    async def _start(self, tree_changed: Callable[[], None]) -> None:
        """``tree_changed``: our child processes changed (the DHT and p2pd started)."""
        cfg = self.config
        raise_open_file_limit()
        if cfg.http_port is not None:  # first, so a slow start shows as "joining" rather than as nothing
            self.status_pages = NodeStatus(self.report)
            await self.status_pages.start(cfg.http_host, cfg.http_port)
        self.dht = await SwarmDHT.start(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                                        announce_maddrs=cfg.announce_maddrs, identity_path=cfg.identity_path,
                                        client_mode=cfg.client_mode, startup_timeout_s=cfg.startup_timeout_s)
        tree_changed()
        await self._new_transport()
        await self._join_run()
        membership = self.membership = Membership(spec=self.spec, dht=self.dht, guard=self.guard, config=cfg,
                                                  record=self.report.record)
        await membership.refresh(all_stages=True)
        if await check_own_reachability(self.dht, self.transport, membership, cfg.initial_peers,
                                        cfg.host_maddrs):
            await self.dht.restart_in_client_mode()
            tree_changed()
            await self.transport.close_lanes()
            await self._new_transport()
            await membership.refresh(all_stages=True)
        # after the first registry read: a prepared dataset's manifest comes from the
        # bootstrap (verified peers when it does not serve it), its tokenizer from peers
        # that hold it, the bootstrap only when none does
        self.data = RunData(self.spec, cache_dir=cfg.data_cache_dir, cache_gb=cfg.data_cache_gb,
                            initial_peers=peer_ids_of(cfg.initial_peers), peers=self._all_live_peers,
                            on_fault=partial(self.guard.fault, reason="bad-data"), progress=cfg.progress,
                            guard=self.guard, private_mirrors=cfg.data_private_mirrors)
        vocab_size = await self.data.open(self.transport, self.compute.unthrottled,
                                          manifest_timeout_s=max(cfg.startup_timeout_s, 300.0))
        self.checkpoints = Checkpoints(cfg.checkpoint_dir, spec=self.spec, compute=self.compute,
                                       command_line=cfg.command_line, identity_path=cfg.identity_path)
        resume = await self.checkpoints.find(cfg.stage)
        await self._take_stage(resume)
        # building it may not fit
        self.compute.explain = partial(explain_run_oom, spec=self.spec, stage=self.stage,
                                       vocab_size=vocab_size, device=cfg.device)
        self.worker = await self.compute.unthrottled(StageWorker, self.spec, self.stage, vocab_size,
                                                     cfg.device)
        if cfg.compile_stage:
            await self.compute.unthrottled(compile_stage, self.worker)
        log.info("node %s: stage %d of %d, %d parameters, run %s (spec %s)", short_id(self.peer_id),
                 self.stage,
                 self.spec.num_stages, sum(p.numel() for p in self.worker.params), self.spec.run_id,
                 self.spec_hash)
        if membership.reachable:
            maddrs = ordered_for_others(self.dht.visible_maddrs())
            log.info("others can join through this node with --initial-peers %s",
                     maddrs[0] if maddrs else "?")
        self._build_components()
        resumed_data = await self._catch_up(resume)
        if self.worker.is_first:
            self.pipeline.open_data(self.data, self.peer_id, resumed_data, claims=self._slot_claims)
        await self._serve()
        self.report.open_metrics()
        membership.state = "training"
        self._training_since, self._training_started_unix = time.monotonic(), time.time()
        await membership.heartbeat()
        await bounded(publish_spec(self.dht, self.spec), 10.0, "publishing the run spec")

    async def _wait_for_peers(self) -> None:
        """Nodes started together wait for each other (NodeConfig.wait_for_peers_per_stage):
        a stage-0 node up seconds before the others, on a loaded machine, could otherwise
        take all of a short run's rounds alone. It waits on its view, which the registry
        loop keeps reading while the heartbeat loop keeps its own record out."""
        want = self.config.wait_for_peers_per_stage
        if want <= 1:
            return
        clock = asyncio.get_running_loop().time
        deadline = clock() + self.config.startup_timeout_s
        stages = range(self.stage, min(self.stage + 2, self.spec.num_stages))  # its partners, its next hop

        def up(stage: int) -> int:
            peers = set(self.membership.live_peers(stage))
            return len(peers | {self.peer_id} if stage == self.stage else peers)

        while short := [s for s in stages if up(s) < want]:
            if clock() >= deadline:
                log.warning("starting without all peers: stage(s) %s have fewer than %d after %.0f s",
                            ", ".join(map(str, short)), want, self.config.startup_timeout_s)
                break
            await asyncio.sleep(self.config.registry_poll_s)
        else:
            log.info("stages %s have %d peers each; training", ", ".join(map(str, stages)), want)
        # compute utilisation's clock starts at the first step the node could take
        self._training_since, self._training_started_unix = time.monotonic(), time.time()

    async def _join_run(self) -> None:
        """Find the run's spec (from the initial peers, or ours when we start the run)."""
        cfg = self.config
        if cfg.initial_peers:
            self.spec, self.publisher = await find_run_spec(self.dht, cfg.initial_peers, run_id=cfg.run_id,
                                                            local_spec=self.spec,
                                                            timeout_s=cfg.spec_find_timeout_s)
            self.spec_hash = self.spec.spec_hash()
        else:
            require_version(self.spec.run_id, self.spec.min_version)
        if not self.spec.admits(self.peer_id):
            raise IncompatibleRun(
                f"run {self.spec.run_id!r} is closed and this node's peer id {self.peer_id} is not "
                "on its list; send the id to the run's host and start again with the same --identity"
            )

    async def _take_stage(self, resume: tuple[dict, dict] | None) -> None:
        membership, cfg = self.membership, self.config
        if resume is not None:
            membership.stage = resume[1]["stage"]  # rejoin the stage the checkpoint holds
        elif cfg.stage is not None:
            membership.stage = cfg.stage
        else:
            await membership.pick_stage()
        if not 0 <= self.stage < self.spec.num_stages:
            raise SwarmError(f"stage {self.stage} does not exist: this run has {self.spec.num_stages} stages")
        if self.stage > 0 and not membership.reachable:
            where = "the checkpoint holds" if resume is not None else "--stage asks for"
            raise ConfigError(
                f"{where} stage {self.stage}, which needs connections from other peers, but none can "
                f"reach this node: {open_port_advice(self.dht)}; or start without --stage (and with "
                "a new --checkpoint-dir) to train stage 0, which only calls out"
            )

    def _build_components(self) -> None:
        cfg, spec, membership, guard = self.config, self.spec, self.membership, self.guard
        services = NodeServices(self.compute, self.transport, guard, self.stats, wire=self.wire)
        self.pipeline = Pipeline(spec=spec, config=cfg, worker=self.worker, gate=self.gate,
                                 next_peers=membership.next_stage_peers, stopping=self.stopping,
                                 services=services)
        numel = sum(p.numel() for p in self.worker.params)
        payload_bytes = int(numel * self.worker.codec.bytes_per_parameter())
        times = ExchangeTimes(cfg.round_timeout_s, cfg.exchange_timeout_for(payload_bytes),
                              link_s=cfg.exchange_link_s(payload_bytes), overlapped=not cfg.blocking_rounds,
                              both_at_once=not cfg.one_payload_at_a_time, payload_bytes=payload_bytes,
                              max_exchange_s=cfg.max_exchange_s)
        self.exchange = OuterExchange(
            spec_hash=self.spec_hash, method=spec.method.name, times=times, state=self.worker, gate=self.gate,
            candidates=membership.partner_candidates,
            callers_expected=membership.callers_expected, announce=membership.round_changed,
            stopping=self.stopping, own_id=self.peer_id, max_update_ratio=cfg.max_update_ratio,
            services=services, gate_holds_steps=self.worker.is_first,
            link_bytes_s=self.pipeline.uplink_bytes_s)
        self.witnesses = Witnesses(worker=self.worker, services=services, spec_hash=self.spec_hash,
                                   partner_spread=self.exchange.check.partner_spread)
        self.state_sync = StateSync(worker=self.worker, spec_hash=self.spec_hash,
                                    donors=partial(membership.callable_peers, self.stage),
                                    witnesses=self.witnesses, stall_s=cfg.state_stall_s,
                                    min_bytes_per_s=cfg.state_min_mbit_s * 1e6 / 8, progress=cfg.progress,
                                    prefer=cfg.state_from, services=services)

    async def _catch_up(self, resume: tuple[dict, dict] | None) -> dict | None:
        """Resume from the checkpoint, then download a live peer's state when the stage is
        ahead of us (far ahead, after a checkpoint). Returns the data position resumed."""
        cfg, data = self.config, None
        def behind() -> int:
            return self.membership.steps_behind(self.worker.inner_step)

        if resume is not None:
            data = await self.checkpoints.resume(self.worker, *resume)
            self.stats.resumed_from_step = self.worker.inner_step
            if cfg.download_state and behind() > cfg.catch_up_rounds * self.spec.method.inner_steps:
                log.warning(
                    "the checkpoint is %d inner steps behind the most advanced peer of stage %d; catching "
                    "up by downloading its state (the data position stays ours)",
                    behind(),
                    self.stage,
                )
                if not await self.state_sync.download():
                    log.warning("no stage-%d peer could give its state; continuing from the checkpoint",
                                self.stage)
                    self.witnesses.catching_up = True
        elif cfg.download_state and behind() > 0 and not await self.state_sync.download():
            log.warning("no stage-%d peer could give its state; starting from the run's initial weights",
                        self.stage)
            self.witnesses.catching_up = True
        return data

    async def _new_transport(self) -> None:
        # counted there
        self.transport = Transport(await self.dht.replicate_p2p(), refusals=self.guard.refusals,
                                   on_fault=partial(self.guard.fault, reason=None),
                                   on_reached=self.guard.reached)
        hosts = lane_hosts(self.config.host_maddrs)
        if self.config.lane_port is not None and hosts:
            try:
                port = await self.transport.open_lanes(hosts, self.config.lane_port,
                                                       authorize=self.guard.admit)
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen for direct lanes on TCP port {self.config.lane_port} ({exc}): "
                    "pass --lane-port with a free port, or --no-lanes"
                ) from None
            log.info(
                "direct lanes for bulk transfers on TCP port %d (others reach it or fall back to libp2p)",
                port,
            )

    async def _serve(self) -> None:
        transport, admit = self.transport, self.guard.admit
        await self.pipeline.serve(transport, admit)
        await self.exchange.serve(transport, admit)
        await transport.serve(protocols.STATUS, partial(handle_status_request, self.report, self.guard.fault),
                              ServeLimits(max_request_bytes=1024, max_concurrent=8, max_per_peer=2,
                                          handler_timeout_s=5.0),
                              authorize=admit)
        if self.membership.reachable:  # a client behind a NAT gets no inbound streams to answer anyway
            await serve_dialback(transport, authorize=admit, on_fault=self.guard.fault)
        await self.state_sync.serve(transport, admit)
        await self.witnesses.serve(transport, admit)
        await self.data.serve(transport, admit)

    def _all_live_peers(self) -> list[str]:
        """Every training peer we know of and can call, any stage: who may hold the dataset's files."""
        if self.membership is None:
            return []
        return [
            p
            for s in range(self.spec.num_stages)
            for p in self.membership.callable_peers(s)
            if p != self.peer_id
        ]

    def _slot_claims(self) -> dict[str, int]:
        return {p: r.data_slot for p, r in self.membership.live_peers(0).items() if r.data_slot >= 0}


async def bounded(awaitable, timeout_s: float, what: str) -> None:
    """``awaitable`` within ``timeout_s``; a time-out or a peer's or the system's error
    is logged and the node goes on (a dead daemon must not hang a start or an exit)."""
    try:
        async with asyncio.timeout(timeout_s):
            await awaitable
    except TimeoutError:
        log.warning("gave up %s after %.0fs", what, timeout_s)
    except (SwarmError, OSError, ConnectionError) as exc:
        log.debug("%s failed: %s", what, exc)
