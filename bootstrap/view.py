"""What the bootstrap knows about the swarm: the latest registry records of every
stage, a bounded history of the swarm's loss and tokens/s, and recent failures. Pure
data: fed snapshots by the peer's poll loop, read by the HTTP handlers.

Records are claims. A peer counts (in the peer count, the swarm's loss and tokens)
only once it is verified: it answered us (the bootstrap asks each new peer for its
status). Forged records are listed, marked unverified, and move no figure. The swarm's
loss is the median of the verified last-stage peers' losses: one liar reporting 53 used
to move a mean of two honest 2.1s to 19."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from swarm_node.net.refusals import REASONS
from swarm_node.obs.prometheus import PrometheusText
from swarm_node.wire.records import PeerRecord

HISTORY_POINTS = 1800  # an hour at the default 2 s poll period
RECENT_FAILURES = 50
GONE_STATES = ("finished", "leaving")
# What the dashboard shows: a record that says "training" is shown as such only while the
# peer makes progress; "starting" before its first step or micro-batch, "stalled" after.
SHOWN_STATES = ("joining", "starting", "training", "stalled", "finished", "leaving")
STALLED_AFTER_S = 10.0  # with no progress in the peer's own last minute, nor seen by us meanwhile


@dataclass
class PeerRow:
    peer_id: str
    record: PeerRecord
    first_seen_s: float
    last_seen_s: float
    last_progress_s: float | None = None  # when we last saw it step or complete micro-batches
    verified: bool = False  # it answered us: a peer exists behind the record

    @property
    def state(self) -> str:
        """The record's state, with "training" checked against the progress seen."""
        if self.record.state != "training":
            return self.record.state
        if self.last_progress_s is None:
            return "starting"
        return "stalled" if self.last_seen_s - self.last_progress_s > STALLED_AFTER_S else "training"

    def to_json(self) -> dict:
        r = self.record
        return {"peer_id": self.peer_id, "short_id": self.peer_id[-6:], "stage": r.stage, "state": self.state,
                "reachable": r.reachable, "recent_steps": r.recent_steps,
                "recent_microbatches": r.recent_microbatches,
                "version": r.version, "throughput_samples_per_s": r.throughput, "queue": r.queue,
                "inner_step": r.inner_step, "outer_round": r.outer_round, "seeking": r.seeking,
                "loss": r.loss,
                "tokens": r.tokens, "microbatches_lost": r.lost, "partner_rounds": r.partner_rounds,
                "local_rounds": r.local_rounds, "last_error": r.last_error, "verified": self.verified,
                "seen_for_s": round(self.last_seen_s - self.first_seen_s, 1)}


@dataclass
class SwarmView:
    run_id: str
    spec_hash: str
    num_stages: int
    allowed_peers: frozenset[str] = frozenset()  # a closed run: records of anyone else are ignored
    started_s: float = field(default_factory=time.time)
    peers: dict[str, PeerRow] = field(default_factory=dict)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    failures: deque = field(default_factory=lambda: deque(maxlen=RECENT_FAILURES))
    failures_total: int = 0
    tokens_total: int = 0
    foreign_records: int = 0  # records of other runs' specs, or unreadable ones, in our keys
    last_poll_s: float | None = None
    _unseen: dict[str, PeerRow] = field(default_factory=dict)  # missing from the last poll only
    verified: set[str] = field(default_factory=set)  # peers that answered us (pruned to the peers listed)

    def mark_verified(self, peer: str) -> None:
        self.verified.add(peer)
        if peer in self.peers:
            self.peers[peer].verified = True

    def unverified(self) -> list[str]:
        return [p for p, row in self.peers.items() if not row.verified]

    def ingest(self, now_s: float, records: dict[str, PeerRecord], foreign: int = 0) -> list[str]:
        """One poll of every stage: ``records`` maps peer id to its latest record.
        Returns one line per peer that joined, left or vanished, for the host's log."""
        previous, previous_poll = self.peers, self.last_poll_s
        events = []
        self.peers = {}
        for peer, record in records.items():
            if (record.spec_hash != self.spec_hash or not 0 <= record.stage < self.num_stages
                    or (self.allowed_peers and peer not in self.allowed_peers)):
                foreign += 1
                continue
            row = previous.get(peer)
            progressed = (record.recent_steps > 0 or record.recent_microbatches > 0
                          or (row is not None and record.inner_step > row.record.inner_step))
            self.peers[peer] = PeerRow(peer, record, row.first_seen_s if row else now_s, now_s,
                                       now_s if progressed else row.last_progress_s if row else None,
                                       # in a closed run only listed peers' signed records are shown
                                       verified=peer in self.verified or bool(self.allowed_peers))
            if row is None and peer not in self._unseen:
                events.append(f"peer {peer[-6:]} joined stage {record.stage} (version {record.version})")
            elif row is not None and record.state in GONE_STATES and row.record.state not in GONE_STATES:
                events.append(f"peer {peer[-6:]} of stage {record.stage} is {record.state}")
            elif row is not None and record.stage != row.record.stage:  # joiners even out the stages
                events.append(f"peer {peer[-6:]} moved from stage {row.record.stage} to stage {record.stage}")
        for peer, row in self.peers.items():
            if peer in previous:
                self._note_changes(now_s, peer, previous[peer].record, row.record)
        # A record missing from one poll may be a DHT hiccup; missing from two, the peer is gone.
        missing = {p: r for p, r in {**self._unseen, **previous}.items()
                   if p not in self.peers and r.record.state not in GONE_STATES}
        self._unseen = {p: r for p, r in missing.items() if p in previous}
        for peer, row in missing.items():
            if peer not in previous:
                self._fail(now_s, peer, row.record.stage, "vanished without leaving (crashed or cut off)")
                events.append(f"peer {peer[-6:]} of stage {row.record.stage} vanished without leaving")
        self.foreign_records = foreign
        self.verified &= {*self.peers, *self._unseen}
        new_tokens = sum(
            max(0, row.record.tokens - previous[p].record.tokens) if p in previous else row.record.tokens
            for p, row in self.peers.items()
            if row.record.stage == 0 and row.verified
        )
        self.tokens_total += new_tokens
        tokens_per_s = None
        if previous_poll is not None and now_s > previous_poll:
            tokens_per_s = new_tokens / (now_s - previous_poll)
        self.last_poll_s = now_s
        self.history.append({"t": round(now_s, 3), "loss": self.swarm_loss(), "tokens_per_s": tokens_per_s,
                             "peers": sum(r.verified for r in self.peers.values()),
                             "tokens": self.tokens_total})
        return events

    def _note_changes(self, now_s: float, peer: str, old: PeerRecord, new: PeerRecord) -> None:
        if new.lost > old.lost:
            self._fail(now_s, peer, new.stage, f"lost {new.lost - old.lost} micro-batches: {new.last_error}")
        elif new.local_rounds > old.local_rounds and len(self.stage_rows(new.stage)) > 1:
            # a peer alone in its stage has nobody to pair with: that is no failure
            self._fail(now_s, peer, new.stage,
                       f"{new.local_rounds - old.local_rounds} round(s) without a partner")
        elif new.last_error and new.last_error != old.last_error and "no partner" not in new.last_error:
            self._fail(now_s, peer, new.stage, new.last_error)

    def _fail(self, now_s: float, peer: str, stage: int, what: str) -> None:
        self.failures_total += 1
        self.failures.append({"t": round(now_s, 3), "peer_id": peer, "short_id": peer[-6:], "stage": stage,
                              "what": what[:200]})

    def stage_rows(self, stage: int, verified_only: bool = False) -> list[PeerRow]:
        return sorted(
            (r for r in self.peers.values() if r.record.stage == stage and (r.verified or not verified_only)),
            key=lambda r: r.peer_id,
        )

    def swarm_loss(self) -> float | None:
        """Median training loss (EMA) reported by the last stage's verified training peers."""
        losses = [r.record.loss for r in self.stage_rows(self.num_stages - 1, verified_only=True)
                  if r.record.loss is not None and r.record.state == "training"]
        return round(statistics.median(losses), 5) if losses else None

    def tokens_per_s(self) -> float | None:
        recent = [p["tokens_per_s"] for p in list(self.history)[-5:] if p["tokens_per_s"] is not None]
        return sum(recent) / len(recent) if recent else None

    def status(self) -> dict:
        stages = []
        for stage in range(self.num_stages):
            rows = self.stage_rows(stage)
            counted = [r for r in rows if r.verified]
            stages.append({"stage": stage, "num_peers": len(counted),
                           "unverified_peers": len(rows) - len(counted),
                           "throughput_samples_per_s": round(sum(r.record.throughput for r in counted), 3),
                           "peers": [r.to_json() for r in rows]})
        return {"run_id": self.run_id, "spec_hash": self.spec_hash, "num_stages": self.num_stages,
                "num_peers": sum(r.verified for r in self.peers.values()),
                "unverified_peers": len(self.unverified()), "loss": self.swarm_loss(),
                "tokens": self.tokens_total,
                "tokens_per_s": self.tokens_per_s(), "stages": stages, "recent_failures": list(self.failures),
                "failures_total": self.failures_total, "foreign_records": self.foreign_records,
                "last_poll": self.last_poll_s}


def prometheus_text(view: SwarmView, *, up: bool, peer_id: str, version: str, now_s: float,
                    refusals: dict[str, int] | None = None) -> str:
    """The Prometheus text exposition format (version 0.0.4); ``refusals``: what the
    bootstrap refused of callers, by reason (net/refusals.py)."""
    out = PrometheusText()
    metric = out.metric

    metric("swarm_bootstrap_info", "gauge", "This bootstrap peer and the run it serves.",
           [({"run_id": view.run_id, "spec_hash": view.spec_hash, "peer_id": peer_id, "version": version},
             1)])
    metric("swarm_bootstrap_up", "gauge", "1 while the bootstrap's DHT is running.", [({}, 1 if up else 0)])
    metric("swarm_bootstrap_uptime_seconds", "gauge", "Seconds since the bootstrap started.",
           [({}, now_s - view.started_s)])
    metric(
        "swarm_peers",
        "gauge",
        "Verified peers (they answered us) with a live registry record, by stage "
        "and state (training: with progress in the last minute; starting: none yet; stalled: none lately).",
        [
            (
                {"stage": s, "state": st},
                sum(1 for r in view.stage_rows(s, verified_only=True) if r.state == st),
            )
            for s in range(view.num_stages)
            for st in SHOWN_STATES
        ],
    )
    metric("swarm_unverified_records", "gauge", "Registry records whose peer has not answered us (yet).",
           [({}, len(view.unverified()))])
    metric("swarm_stage_throughput_samples_per_second", "gauge",
           "Sum of the stage's verified peers' throughput.",
           [({"stage": s}, sum(r.record.throughput for r in view.stage_rows(s, verified_only=True)))
            for s in range(view.num_stages)])
    metric("swarm_tokens", "counter",
           "Tokens fed into the pipeline by stage-0 peers, as seen by this bootstrap.",
           [({}, view.tokens_total)])
    metric("swarm_tokens_per_second", "gauge", "Swarm tokens/s over the last polls.",
           [({}, view.tokens_per_s() or 0.0)])
    loss = view.swarm_loss()
    metric("swarm_train_loss", "gauge", "Median training loss reported by the last stage's verified peers.",
           [({}, loss if loss is not None else math.nan)])
    metric("swarm_failures", "counter", "Failure events seen in peer records (lost micro-batches, rounds "
           "without partner, vanished peers).", [({}, view.failures_total)])
    metric("swarm_foreign_records", "gauge", "Registry records of another spec or unreadable.",
           [({}, view.foreign_records)])
    metric("swarm_bootstrap_refusals", "counter", "What the bootstrap refused of callers, by reason.",
           [({"reason": r}, (refusals or {}).get(r, 0)) for r in REASONS])
    rows = sorted(view.peers.values(), key=lambda r: (r.record.stage, r.peer_id))
    per_peer = [
        ("swarm_peer_inner_step", "gauge", "Inner optimizer steps taken.", lambda r: r.inner_step),
        ("swarm_peer_outer_round", "gauge", "Outer rounds done.", lambda r: r.outer_round),
        ("swarm_peer_throughput_samples_per_second", "gauge", "Peer's stage compute throughput.",
         lambda r: r.throughput),
        ("swarm_peer_queue", "gauge", "Micro-batches waiting or in flight at the peer.", lambda r: r.queue),
        ("swarm_peer_microbatches_lost", "counter", "Micro-batches the peer gave up on.", lambda r: r.lost),
        ("swarm_peer_partner_rounds", "counter", "Outer rounds averaged with a partner.",
         lambda r: r.partner_rounds),
        ("swarm_peer_local_rounds", "counter", "Outer rounds without a partner.", lambda r: r.local_rounds),
    ]
    for name, kind, help_text, value_of in per_peer:
        metric(name, kind, help_text, [({"peer": r.peer_id, "stage": r.record.stage}, value_of(r.record))
                                       for r in rows])
    metric("swarm_peer_loss", "gauge", "Last stage: the peer's training loss (EMA).",
           [({"peer": r.peer_id, "stage": r.record.stage},
             r.record.loss) for r in rows if r.record.loss is not None])
    return out.text()
