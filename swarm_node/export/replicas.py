"""Which checkpoints of one stage may be averaged. Peers of a stage are replicas of one
run that pairwise averaging keeps close; their mean is a model only while they are at
about the same point of training. Checkpoints written far apart (a peer that left early,
a stale directory) would average weights the optimizer never held together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm_node.errors import ConfigError
from swarm_node.spec import RunSpec

MAX_ROUNDS_APART = 2
# Without outer rounds (local-only training) there is no natural unit; a tenth of the newest
# checkpoint's steps keeps peers that stopped at about the same time together.
MAX_RELATIVE_STEPS_APART = 0.10

SPREAD_RULE = (f"more than {MAX_ROUNDS_APART} outer rounds or {MAX_ROUNDS_APART}*H inner steps apart, H being the "
               f"run's method.inner_steps; for a run without outer rounds (method local): more than "
               f"{MAX_RELATIVE_STEPS_APART:.0%} of the newest checkpoint's inner steps apart")


@dataclass(frozen=True)
class StageCheckpoint:
    path: Path  # as given on the command line
    stage: int
    peer_id: str | None
    inner_step: int
    outer_round: int | None


def refuse_same_peer_twice(checkpoints: list[StageCheckpoint]) -> None:
    """One peer's checkpoints are one replica at different times, not two replicas:
    averaging them would count that peer twice (no --force overrides this)."""
    seen: dict[tuple[int, str], StageCheckpoint] = {}
    for c in checkpoints:
        if c.peer_id is None:
            continue
        first = seen.setdefault((c.stage, c.peer_id), c)
        if first is not c:
            raise ConfigError(f"stage {c.stage} is given twice from peer {c.peer_id} ({_describe(first)}; "
                              f"{_describe(c)}): export the newest checkpoint of each peer")


def far_apart(spec: RunSpec, checkpoints: list[StageCheckpoint]) -> str | None:
    """Why the checkpoints of one stage are too far apart to average, or None."""
    steps = [c.inner_step for c in checkpoints]
    step_spread = max(steps) - min(steps)
    if spec.method.has_outer_step:
        rounds = [c.outer_round for c in checkpoints if c.outer_round is not None]
        if rounds and max(rounds) - min(rounds) > MAX_ROUNDS_APART:
            return f"more than {MAX_ROUNDS_APART} outer rounds apart"
        limit = MAX_ROUNDS_APART * spec.method.inner_steps
        if step_spread > limit:
            return f"more than {MAX_ROUNDS_APART}*H = {limit} inner steps apart"
        return None
    if step_spread > MAX_RELATIVE_STEPS_APART * max(steps):
        return f"more than {MAX_RELATIVE_STEPS_APART:.0%} of the newest one's {max(steps)} inner steps apart"
    return None


def check_stage_spread(spec: RunSpec, checkpoints: list[StageCheckpoint], *, force: bool) -> str | None:
    """Refuses a stage whose checkpoints are far apart; with ``force``, returns the
    warning to give instead (None when they are close)."""
    reason = far_apart(spec, checkpoints)
    if reason is None:
        return None
    stage = checkpoints[0].stage
    listed = "; ".join(_describe(c) for c in checkpoints)
    if not force:
        raise ConfigError(f"stage {stage}: the checkpoints are {reason} ({listed}), so their average is no model "
                          "of the run; give checkpoints of about the same point of training, or pass --force to "
                          "average them anyway")
    return f"stage {stage}: averaging checkpoints {reason} as --force asks ({listed})"


def _describe(c: StageCheckpoint) -> str:
    where = f"{c.path} at inner step {c.inner_step}"
    return where if c.outer_round is None else f"{where}, outer round {c.outer_round}"
