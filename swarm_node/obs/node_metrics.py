"""A node's own /metrics (Prometheus text) and /api/status, from plain data: its
registry record and summary. The bootstrap's /metrics shows the whole swarm; this one is
for a host that scrapes its own machines."""

from __future__ import annotations

import math

from swarm_node.net.refusals import REASONS
from swarm_node.obs.prometheus import PrometheusText
from swarm_node.wire.records import PeerRecord

COUNTERS = (
    ("microbatches_done", "Micro-batches this node completed."),
    ("microbatches_lost", "Micro-batches this node gave up on."),
    ("retries", "Hops retried on another peer."),
    ("rounds_with_partner", "Outer rounds averaged with a partner."),
    ("local_only_rounds", "Outer rounds without a partner."),
    ("bytes_sent", "Bytes this node sent over its streams."),
    ("bytes_received", "Bytes this node received over its streams."),
    ("tokens", "Tokens this node fed into the pipeline (stage 0)."),
)


def node_metrics_text(record: PeerRecord, summary: dict, *, run_id: str, version: str) -> str:
    out = PrometheusText()
    labels = {"peer": summary["peer_id"], "stage": record.stage}
    out.metric("swarm_node_info", "gauge", "This node and the run it trains.",
               [({**labels, "run_id": run_id, "spec_hash": record.spec_hash, "version": version}, 1)])
    states = ("joining", "training", "finished", "leaving")
    out.metric("swarm_node_state", "gauge", "1 for the node's current state.",
               [({**labels, "state": s}, 1 if record.state == s else 0) for s in states])
    out.metric("swarm_node_inner_step", "gauge", "Inner optimizer steps taken.",
               [(labels, record.inner_step)])
    out.metric("swarm_node_outer_round", "gauge", "Outer rounds done.", [(labels, record.outer_round)])
    out.metric("swarm_node_throughput_samples_per_second", "gauge", "Stage compute throughput (EMA).",
               [(labels, record.throughput)])
    out.metric("swarm_node_queue", "gauge", "Micro-batches waiting or in flight here.",
               [(labels, record.queue)])
    out.metric("swarm_node_train_loss", "gauge", "Last stage: training loss (EMA).",
               [(labels, record.loss if record.loss is not None else math.nan)])
    for key, help_text in COUNTERS:
        out.metric(f"swarm_node_{key}", "counter", help_text, [(labels, int(summary.get(key, 0)))])
    boundaries = summary.get("boundaries") or {}
    out.metric("swarm_node_boundary_bytes_per_token", "gauge", "Bytes a token moved across a stage boundary "
               "this node is on, each way (activations or gradients, scales, headers, targets).",
               [({**labels, "boundary": b, "direction": d}, per[d]) for b, per in boundaries.items()
                for d in ("sent", "received")])
    out.metric("swarm_node_link_wait_share", "gauge", "Stage 0: share of the time since training began "
               "that it held a full window, waiting on its link and the stages after.",
               [(labels, float(summary.get("link_wait_share", 0.0)))])
    refusals = summary.get("refusals") or {}
    out.metric("swarm_node_refusals", "counter", "What this node refused of other peers, by reason "
               "(docs/PROTOCOL.md 2.2).", [({**labels, "reason": r}, int(refusals.get(r,
                                                                                      0))) for r in REASONS])
    return out.text()
