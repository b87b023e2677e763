"""What the volunteer sees of a running node (obs/progress.py's status line), gathered
every second from the node's components, which the node hands the feed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from swarm_node.gossip.exchange import OuterExchange
from swarm_node.membership.view import Membership
from swarm_node.net.transport import short_id
from swarm_node.obs.progress import NodeProgress, NodeSnapshot
from swarm_node.obs.recent import RecentGrowth
from swarm_node.obs.stats import NodeStats
from swarm_node.spec import RunSpec
from swarm_node.train.pipeline import Pipeline
from swarm_node.train.worker import StageWorker

TOKEN_RATE_WINDOW_S = 30.0


class ProgressFeed:
    def __init__(self, *, spec: RunSpec, max_steps: int | None, worker: StageWorker, pipeline: Pipeline,
                 membership: Membership, exchange: OuterExchange, stats: NodeStats,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self.max_steps, self.worker, self.pipeline = spec, max_steps, worker, pipeline
        self.membership, self.exchange, self.stats = membership, exchange, stats
        self._token_rate = RecentGrowth(window_s=TOKEN_RATE_WINDOW_S, clock=clock)
        self._recent_microbatches = RecentGrowth(clock=clock)

    async def run(self, log: logging.Logger, live: bool) -> None:
        progress = NodeProgress(log, live=live)
        try:
            while True:
                await asyncio.sleep(progress.period_s)
                progress.show(self.snapshot())
        finally:
            progress.close()

    def snapshot(self) -> NodeSnapshot:
        w, stats, stage = self.worker, self.stats, self.membership.stage
        tokens_per_microbatch = self.spec.batch_size * self.spec.seq_len
        grown, span_s = self._token_rate.sample_rate(stats.microbatches_done)
        last = self.exchange.last
        recent, watched_s = self._recent_microbatches.sample_rate(stats.microbatches_done)
        # "stalled" only once a whole window was watched: a node up for a second has done
        # nothing yet, and its first line said "no work ... in the last minute"
        quiet = not recent and watched_s >= self._recent_microbatches.window_s
        return NodeSnapshot(
            inner_step=w.inner_step, max_steps=self.max_steps,
            loss=w.loss_ema if w.is_last else self.pipeline.loss_seen,
            tokens_per_s=grown * tokens_per_microbatch / span_s if span_s > 0 else 0.0,
            stage=stage, num_stages=self.spec.num_stages,
            peers_in_stage=len(self.membership.live_peers(stage)),
            last_round=last.round_no if last else None,
            last_partner=short_id(last.partners[0]) if last and last.partners else None,
            last_round_ago_s=asyncio.get_running_loop().time() - last.ended_at if last else None,
            stalled=stats.last_error or self._waiting_for() if quiet else None)

    def _waiting_for(self) -> str:
        stage = self.membership.stage
        if self.worker.is_first and not self.worker.is_last:
            if self.pipeline.waiting_for_next_stage:
                return f"waiting for a stage-{stage + 1} peer to join"
            return f"no micro-batch came back from stage {stage + 1} in the last minute"
        return f"no work from stage {stage - 1} in the last minute" if stage else "nothing done"
