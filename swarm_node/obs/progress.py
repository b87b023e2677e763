"""Progress bars for training runs and their final evaluation (tqdm on a terminal,
sparse lines otherwise), and what the volunteer sees of a running node: one status line
(inner step, loss, tokens/s, peers in its stage, the last round and its partner),
redrawn every second on a terminal, logged once a minute elsewhere (node/progress_feed.py
gathers its figures from the node's components)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm


def _redraw_interval_s() -> float:
    # On a non-terminal (CI logs) redraw rarely so logs stay short.
    return 0.2 if sys.stderr.isatty() else 15.0


class TrainingProgress:
    def __init__(self, total_steps: int, description: str, enabled: bool = True):
        self.bar = tqdm(total=total_steps, desc=description, unit="step", disable=not enabled,
                        mininterval=_redraw_interval_s(), dynamic_ncols=True, file=sys.stderr)
        self.last_val: float | None = None

    def update(self, step: int, tokens: int, train_loss: float | None, val_loss: float | None,
               elapsed_s: float) -> None:
        """``train_loss`` is None until there is one (a swarm's last stage reports its first
        loss some seconds after stage 0 starts); the bar then shows no loss rather than a
        placeholder."""
        if val_loss is not None:
            self.last_val = val_loss
        postfix = {}
        if train_loss is not None:
            postfix["loss"] = f"{train_loss:.3f}"
        postfix["tok/s"] = f"{tokens / max(elapsed_s, 1e-9):,.0f}"
        if self.last_val is not None:
            postfix["val"] = f"{self.last_val:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def finish(self, step: int) -> None:
        """Show the last step reached, so the bar does not stop short of where the run did."""
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class EvaluationProgress:
    """The final evaluation of several model paths: a bar of validation batches on a
    terminal, and one log line per path wherever the output goes."""

    def __init__(self, paths: int, batches_per_path: int, log: logging.Logger, enabled: bool = True):
        self.paths = paths
        self.log = log
        self.done = 0
        self.bar = tqdm(total=paths * batches_per_path, desc="final evaluation", unit="batch",
                        disable=not enabled or not sys.stderr.isatty(), mininterval=_redraw_interval_s(),
                        dynamic_ncols=True, file=sys.stderr, leave=False)

    def start(self, what: str) -> None:
        self.bar.set_description(f"evaluating {what} ({self.done + 1} of {self.paths})", refresh=False)

    def advance(self) -> None:
        self.bar.update(1)

    def finished(self, what: str, loss: float, seconds: float) -> None:
        self.done += 1
        self.bar.clear()  # the log line must not land inside the bar
        self.log.info("evaluated %s (%d of %d): val loss %.4f in %.1f s", what, self.done, self.paths, loss,
                      seconds)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


@dataclass(frozen=True)
class NodeSnapshot:
    """What a volunteer wants to see of its node at a glance."""
    inner_step: int
    max_steps: int | None
    loss: float | None  # the last stage's training loss, as the node last saw it
    tokens_per_s: float
    stage: int
    num_stages: int
    peers_in_stage: int  # live peers of our stage besides us
    last_round: int | None = None
    last_partner: str | None = None  # short id; None: the last round was local-only
    last_round_ago_s: float | None = None
    stalled: str | None = None  # why nothing completed lately, when nothing did


def node_status_line(s: NodeSnapshot) -> str:
    step = f"step {s.inner_step:,}" + (f"/{s.max_steps:,}" if s.max_steps else "")
    parts = [
        step,
        f"loss {s.loss:.3f}" if s.loss is not None else "loss -",
        f"{s.tokens_per_s:,.0f} tok/s",
        f"stage {s.stage} of {s.num_stages} with {s.peers_in_stage} other "
        f"peer{'s' if s.peers_in_stage != 1 else ''}",
    ]
    if s.last_round is not None:
        who = f"with {s.last_partner}" if s.last_partner else "alone"
        parts.append(f"round {s.last_round} {who} {s.last_round_ago_s:.0f}s ago")
    if s.stalled:
        parts.append(f"stalled: {s.stalled}")
    return " | ".join(parts)


class NodeProgress:
    """A node's status: one live line on a terminal, redrawn every second; elsewhere (a
    service's log, --no-progress) a log line a minute. It is fed every second either
    way, so rates cover the recent past."""

    period_s = 1.0

    def __init__(self, log: logging.Logger, live: bool, log_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.log = log
        self.live = live
        self.log_every_s = log_every_s
        self.clock = clock
        self._next_log_s = clock() + log_every_s
        self.bar = tqdm(total=None, bar_format="{desc}", file=sys.stderr, dynamic_ncols=True,
                        disable=not live,
                        leave=False)

    def show(self, snapshot: NodeSnapshot) -> None:
        line = node_status_line(snapshot)
        if self.live:
            self.bar.set_description_str(line)
        elif self.clock() >= self._next_log_s:
            self._next_log_s += self.log_every_s
            self.log.info("progress: %s", line)

    def close(self) -> None:
        self.bar.close()
