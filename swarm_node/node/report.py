"""What a node tells others and leaves behind: the registry record its heartbeat
publishes, its status answer and pages, its counters and summary, the metrics it logs
after each round, and the weights and summary files it writes at exit. Read-only views of
the node's components (the conductor owns them)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from swarm_node import __version__
from swarm_node.obs.recent import RecentGrowth
from swarm_node.obs.sinks import Sinks, open_sinks
from swarm_node.obs.stats import training_until
from swarm_node.system import write_atomic
from swarm_node.wire.records import PeerRecord

if TYPE_CHECKING:
    from swarm_node.data.source import RunData
    from swarm_node.gossip.exchange import OuterExchange
    from swarm_node.membership.view import Membership
    from swarm_node.net.dht import SwarmDHT
    from swarm_node.net.guard import PeerGuard
    from swarm_node.net.transport import Transport
    from swarm_node.node_config import NodeConfig
    from swarm_node.obs.stats import NodeStats
    from swarm_node.spec import RunSpec
    from swarm_node.train.pipeline import Pipeline
    from swarm_node.train.rounds import RoundGate
    from swarm_node.train.worker import StageWorker

log = logging.getLogger("swarm_node.node")


class ReportedNode(Protocol):
    """What the report reads of the node (node/conductor.py's Node hands itself in): its
    settings, its components (None until started) and the clocks of its training time."""
    spec: RunSpec | None
    spec_hash: str | None
    config: NodeConfig
    status: str
    stats: NodeStats
    gate: RoundGate
    guard: PeerGuard
    dht: SwarmDHT | None
    transport: Transport | None
    membership: Membership | None
    data: RunData | None
    worker: StageWorker | None
    pipeline: Pipeline | None
    exchange: OuterExchange | None
    _training_since: float | None
    _training_started_unix: float | None
    _last_round_opened_at: float | None
    _held_at_last_open: float

    @property
    def peer_id(self) -> str: ...

    @property
    def stage(self) -> int | None: ...

    @property
    def state(self) -> str: ...


class NodeReport:
    def __init__(self, node: ReportedNode):
        self.node = node
        self.metrics: Sinks | None = None
        self._recent_steps = RecentGrowth()
        self._recent_microbatches = RecentGrowth()

    def record(self) -> PeerRecord | None:
        """What our heartbeat publishes (None before we know our stage)."""
        n = self.node
        if n.membership is None or n.stage is None:
            return None
        w, stats, pipeline = n.worker, n.stats, n.pipeline
        return PeerRecord(stage=n.stage, spec_hash=n.spec_hash, version=__version__, state=n.state,
                          throughput=round(pipeline.throughput, 3) if pipeline else 0.0,
                          queue=pipeline.queue if pipeline else 0,
                          inner_step=w.inner_step if w else 0, outer_round=w.outer_round if w else 0,
                          seeking=n.exchange is not None and n.exchange.seeking,
                          round_step=w.inner_step - w.last_round_step if w else 0,
                          loss=round(w.loss_ema, 5) if w and w.loss_ema is not None else None,
                          tokens=stats.tokens, lost=stats.microbatches_lost,
                          partner_rounds=stats.rounds_with_partner, local_rounds=stats.local_only_rounds,
                          last_error=stats.last_error, reachable=n.membership.reachable,
                          recent_steps=self._recent_steps.sample(w.inner_step if w else 0),
                          recent_microbatches=self._recent_microbatches.sample(stats.microbatches_done),
                          data_slot=n.data.claimed_slot() if n.data is not None else -1)

    def status_fields(self) -> dict:
        n = self.node
        spec, w = n.spec, n.worker
        return {"run_id": spec.run_id if spec else None, "spec_hash": n.spec_hash, "version": __version__,
                "peer_id": n.peer_id, "stage": n.stage, "num_stages": spec.num_stages if spec else None,
                "state": n.state, "inner_step": w.inner_step if w else 0,
                "outer_round": w.outer_round if w else 0,
                "peers_per_stage": [len(n.membership.live_peers(s)) if n.membership else 0
                                    for s in range(spec.num_stages)] if spec else []}

    def counters(self) -> dict:
        n = self.node
        transport = n.transport
        return {"peer_id": n.peer_id, "stage": n.stage, "status": n.status,
                "bytes_sent": transport.bytes_sent if transport else 0,
                "bytes_received": transport.bytes_received if transport else 0,
                "round_held_s": round(n.gate.held_s, 3),
                "training_s": round(n.worker.training_s, 3) if n.worker else 0.0, **asdict(n.stats),
                "boundaries": n.stats.boundaries(n.stage), "link_wait_share": self._link_wait_share(),
                "in_flight_window": n.pipeline.window_size if n.pipeline else 0,
                "hop_deadline_s": round(n.pipeline.hop_deadline_s, 1) if n.pipeline else 0.0,
                "data": n.data.status() if n.data is not None else None,
                "refusals": n.guard.refusals.as_dict(),
                **{f"dht_{k}": v for k, v in (asdict(n.dht.ops) if n.dht else {}).items()}}

    def _link_wait_share(self) -> float:
        """Of the time since training began, the share stage 0 held a full window."""
        since = self.node._training_since
        elapsed = time.monotonic() - since if since is not None else 0.0
        return round(min(1.0, self.node.stats.link_wait_s / elapsed), 4) if elapsed > 0 else 0.0

    def health(self) -> tuple[str, bool]:
        n = self.node
        return n.state, n.dht is not None and n.dht.is_alive()

    def summary(self) -> dict:
        n = self.node
        w = n.worker
        since = n._training_since
        until = training_until(w.last_step_at if w else None, n._last_round_opened_at, time.monotonic())
        # the steps' stand-stills over the same clock: up to the last round's opening if it ends it
        held_s = n._held_at_last_open if until == n._last_round_opened_at else n.gate.held_s
        return {**self.counters(), "round_held_s": round(held_s, 3), "pid": os.getpid(),
                "inner_steps": w.inner_step if w else 0,
                "training_wall_s": round(until - since, 3) if since is not None else 0.0,
                "training_started_unix": n._training_started_unix,
                "outer_rounds": w.outer_round if w else 0, "spec_hash": n.spec_hash,
                "final_theta_digest": w.theta_digest() if w else None}

    def open_metrics(self) -> None:
        n = self.node
        cfg = n.config
        if not cfg.metrics_sinks:
            return
        directory = cfg.metrics_dir or cfg.run_dir or Path("runs") / n.spec.run_id
        self.metrics = open_sinks(cfg.metrics_sinks, directory, run_name=self.tag(), project=n.spec.run_id,
                                  config={"spec": n.spec.to_dict(), "stage": n.stage, "peer_id": n.peer_id})
        log.info("metrics (%s) go to %s", ", ".join(cfg.metrics_sinks), directory)

    def tag(self) -> str:
        n = self.node
        return f"stage{n.stage}-{n.peer_id[-8:]}"

    def log_metrics(self) -> None:
        n = self.node
        if self.metrics is None or n.worker is None or n.transport is None:
            return
        w, stats = n.worker, n.stats
        values = {"outer_round": w.outer_round, "throughput_samples_per_s": n.pipeline.throughput,
                  "tokens": stats.tokens, "microbatches_done": stats.microbatches_done,
                  "microbatches_lost": stats.microbatches_lost, "retries": stats.retries,
                  "rounds_with_partner": stats.rounds_with_partner,
                  "local_only_rounds": stats.local_only_rounds,
                  "bytes_sent": n.transport.bytes_sent, "bytes_received": n.transport.bytes_received,
                  "streams_served": n.transport.streams_served}
        data = n.data.status() if n.data is not None else None
        if data is not None:
            values |= {"data_fetched_bytes": data["fetched_bytes"], "data_served_bytes": data["served_bytes"]}
        if w.loss_ema is not None:
            values["train_loss"] = w.loss_ema
        self.metrics.log(w.inner_step, values)

    def write_outputs(self) -> None:
        n = self.node
        run_dir = n.config.run_dir
        if run_dir is None or n.worker is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        tag = self.tag()
        torch.save({k: v.detach().cpu() for k, v in n.worker.stage.state_dict().items()},
                   run_dir / f"weights-{tag}.pt.tmp")
        os.replace(run_dir / f"weights-{tag}.pt.tmp", run_dir / f"weights-{tag}.pt")
        summary = self.summary()
        summary["weights_file"] = f"weights-{tag}.pt"
        write_atomic(run_dir / f"summary-{tag}.json", json.dumps(summary, indent=2))


