"""Pure bookkeeping shared by the benchmarks that race swarm-node against hivemind
(bench.vs_hivemind, bench.home_link): from evaluated snapshots to curves, a target loss
both methods reach, the time each needs for it, and bytes at a given time."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One peer's weights after ``step`` local steps, evaluated."""
    replica: int
    step: int
    time_s: float  # since the swarm was launched
    val_loss: float
    # the synchronisations the peer had done when it was taken, where it says (a
    # swarm-node checkpoint's outer round); None: read it off ``step``
    sync: int | None = None


@dataclass(frozen=True)
class CurvePoint:
    step: float  # the peers' mean inner step
    time_s: float
    val_loss: float
    peers: int


def swarm_curve(points: Sequence[Point], num_peers: int, steps_per_sync: int) -> list[CurvePoint]:
    """The swarm's curve, one point per synchronisation: each peer's latest snapshot
    nearest to it (a NoLoCo node may take a round early, at another step than its
    partner), the mean val loss over the peers, at the time the last of them got there.
    Points some peer lacks are dropped (a snapshot missed, a peer stopped early). A
    snapshot far off every synchronisation (a peer stopped at a time limit between
    two) belongs to a last point of its own: it used to take the place of the one
    before it, and a run stopped 15 steps after its first synchronisation showed none.
    A point that names its synchronisation belongs to it wherever its step lies: an
    overlapped round's checkpoint comes when the exchange lands, up to a round of steps
    after the boundary."""
    by_sync: dict[float, dict[int, Point]] = defaultdict(dict)
    for p in sorted(points, key=lambda p: (p.step, p.time_s)):
        if p.sync is not None:
            by_sync[p.sync][p.replica] = p
            continue
        sync = round(p.step / steps_per_sync)
        on_grid = abs(p.step - sync * steps_per_sync) <= steps_per_sync / 4
        by_sync[sync if on_grid else math.inf][p.replica] = p  # the latest wins
    curve = []
    for sync in sorted(by_sync):
        group = by_sync[sync].values()
        if len(group) < num_peers:
            continue
        curve.append(CurvePoint(sum(p.step for p in group) / len(group), max(p.time_s for p in group),
                                sum(p.val_loss for p in group) / len(group), len(group)))
    return curve


def common_target(finals: Sequence[float], initial: float, margin: float = 0.1, decimals: int = 2) -> float:
    """A target every method reaches before its last point: the worst final loss plus
    ``margin`` of the way back up to the initial loss, rounded up. (A method's last
    point can come late for reasons that have nothing to do with training, such as a
    partner that already left.)"""
    worst = max(finals)
    scale = 10 ** decimals
    return math.ceil((worst + margin * (initial - worst)) * scale) / scale


def time_to_target(curve: Sequence[CurvePoint], target: float) -> float | None:
    """When the curve first gets to ``target``, interpolated linearly in time between
    the last point above it and the first at or below; None if it never does."""
    for before, after in zip([None, *curve[:-1]], curve):
        if after.val_loss <= target:
            if before is None or before.val_loss == after.val_loss:
                return after.time_s
            share = (before.val_loss - target) / (before.val_loss - after.val_loss)
            return before.time_s + share * (after.time_s - before.time_s)
    return None


def value_at(samples: Sequence[tuple[float, float]], t: float) -> float | None:
    """A sampled counter (time, value), interpolated linearly at ``t`` (clamped to the
    samples' range); None without samples."""
    if not samples:
        return None
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
