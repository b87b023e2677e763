"""What a partner's (phi, Delta) must pass before it is averaged in.

First it must fit our stage: as many tensors as ours, the same shapes, floating point,
finite. Then it is held to our scale, the norm of our own Delta now over a whole round
(docs/ALGORITHM.md 3.5 has the measurements). Nothing a partner sends moves it.

- Each of our Delta norms is stretched to a whole round by 1/sqrt(fraction): a Delta
  grows with the square root of its steps, as a random walk (rounds taken at 0.5-0.9 of
  their steps had sqrt(fraction) of a whole round's norm, within 0.03).
- The scale is the larger of the median of our last SCALE_ROUNDS rounds and the latest
  (a rising learning rate, in warm-up, raises it at once). A longer memory is a stale
  scale: as the learning rate decays, the median of 32 rounds stood 1.3x above our
  Delta at the median and 2.2x at the 90th percentile, and a peer that added 5x its
  own Delta norm to everything it sent was under 3x of it.
- A partner that says which inner steps its Delta covers is held to the smaller of our
  scale and our scale for those steps: our Delta norm per unit of sqrt(sum of lr^2)
  over our own steps (the run's schedule), times that of its steps. A round taken early,
  or behind ours in warm-up, covers fewer steps at lower learning rates: an honest one
  has a smaller Delta, and 5x of such a Delta could be under 3x of our scale.

- A Delta norm above ``max_update_ratio`` times our scale is a poisoned update when
  the partner is at our round (Poisoned: the exchange keeps it off for half an hour).
  At another round it is declined (RoundsApart): one round ahead in warm-up an honest
  partner's learning rate is higher, and rounds ahead it trained alone while we
  started; the one far behind catches up by downloading the stage's state.
- A phi far from ours is no proof of anything: honest replicas that trained apart
  (a partition, a late start) are far apart too. It is declined only when the partner
  is two or more rounds away (so the one behind catches up instead). Far is measured
  in our scale, and, when the partner is ahead, in its own Delta's if that is smaller:
  the partner judges us in its scale, and the one behind may take the larger steps
  (judged in its own scale only, a peer far behind would go on averaging with partners
  that decline it every time, and never catch up). Otherwise it counts as the point
  ``clip_ratio`` times our scale on the way to it, so partners apart converge again a
  step at a time and an attacker pulls by a bounded amount.
- An accepted Delta above ``clip_ratio`` times our scale is scaled down to it.

Before our first round the only scale we have is our progress so far, and a partner a
round ahead of a node in warm-up (or started late) is out of it honestly: such an
exchange is declined (Refused), not punished.

The round a partner claims only chooses between declining, rejecting and clipping, and
the steps it claims can only make its scale smaller than ours: a liar gains nothing it
could not get by telling the truth.

Everything here runs on the compute thread."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from swarm_node.errors import ProtocolError
from swarm_node.gossip.pairing import Refused
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.wire.frames import finite


class Poisoned(ProtocolError):
    """A partner at our round sent a Delta far out of our scale."""


class RoundsApart(Refused):
    """A partner at another round is out of our scale: declined, nobody punished."""

    def __init__(self, why: str, rounds_ahead: int):
        super().__init__(f"rounds-apart ({why})")
        self.rounds_ahead = rounds_ahead  # how far the partner says it is ahead of us


def norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


def tensor_distances(theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor]) -> list[float]:
    """Per tensor; the partner's tensors were decoded on the CPU, ours live on the training device."""
    return [float((t.to(o.device, torch.float32) - o).norm()) for t, o in zip(theirs, ours)]


def distance(theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(d * d for d in tensor_distances(theirs, ours)))


def fit_problem(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> str | None:
    """Why a partner's phi or Delta (one tensor a parameter) does not fit a stage of
    ``shapes``, or None."""
    expected = list(shapes)
    if len(tensors) != len(expected):
        return f"expected {len(expected)} tensors, got {len(tensors)}"
    for t, shape in zip(tensors, expected):
        if t.shape != shape or not t.dtype.is_floating_point:
            return f"tensor of shape {tuple(t.shape)} / {t.dtype} does not fit {tuple(shape)}"
        if not finite(t):
            return "non-finite values"
    return None


ROUNDS_APART = 2  # a partner this many rounds ahead and far off: we are behind, catch up
SCALE_ROUNDS = 5  # our last rounds whose median Delta norm (or the latest, if larger) is our scale
ROUNDS_CLAIMED = 4  # a claim of the steps a Delta covers counts at most this many rounds of them
SPREAD_ROUNDS = 4  # partners' phi distances kept, for joiners checking a state (state/check.py)
DISTANCE_SLACK = 2.0  # a phi this many times the Delta bound away, rounds apart: declined


class StepSchedule(Protocol):
    """The run's inner steps, as every peer of it has them (train/worker.py's StageWorker)."""

    @property
    def round_steps(self) -> int: ...

    def learning_rate(self, step: int) -> float: ...


class PartnerCheck:
    def __init__(self, max_update_ratio: float, clip_ratio: float = 1.5,
                 schedule: StepSchedule | None = None):
        if clip_ratio <= 1:
            raise ValueError("clip_ratio must be above 1")
        self.max_update_ratio = max_update_ratio
        self.clip_ratio = min(clip_ratio, max_update_ratio)
        self.schedule = schedule  # the run's learning rates (None: unknown)
        # only ever fed our own Delta norms: each stretched to a whole round, and each per unit of
        # its steps' learning rates (norm / sqrt(sum of lr^2)), for partners that say their steps
        self._own = MagnitudeScreen(max_update_ratio, window=SCALE_ROUNDS)
        self._latest: float | None = None
        self._per_lr = MagnitudeScreen(max_update_ratio, window=SCALE_ROUNDS)
        self._per_lr_latest: float | None = None
        self._phi_distances: deque[list[float]] = deque(maxlen=SPREAD_ROUNDS)
        self._partner_delta_norm: float | None = None  # of the Delta checked last: its phi comes next

    def note_own_delta(self, own_delta: Sequence[torch.Tensor], round_fraction: float = 1.0,
                       steps: tuple[int, int] | None = None) -> float:
        """At the start of each of our rounds: our own Delta norm, over ``round_fraction``
        of a round's inner steps (``steps``: which), sets the scale partners are held to.
        Returns the norm."""
        value = norm(own_delta)
        stretched = value / math.sqrt(min(1.0, max(round_fraction, 0.1)))
        if math.isfinite(stretched):
            self._own.note(stretched)
            self._latest = stretched
        rates = self._rates(steps)
        if rates is not None and math.isfinite(value / rates):
            self._per_lr.note(value / rates)
            self._per_lr_latest = value / rates
        return value

    def reference(self, steps: tuple[int, int] | None = None) -> float | None:
        """The scale partners are held to now; for a partner that says its Delta covers
        ``steps``, the smaller of that and our scale for those steps' learning rates."""
        median = self._own.reference()
        if median is None or self._latest is None:
            return None
        now = max(median, self._latest)
        per_lr, rates = self._per_lr.reference(), self._rates(steps)
        if per_lr is None or self._per_lr_latest is None or rates is None:
            return now
        return min(now, max(per_lr, self._per_lr_latest) * rates)

    def _rates(self, steps: tuple[int, int] | None) -> float | None:
        """sqrt(sum of lr^2) over ``steps`` (a Delta's norm grows so with its steps), one
        step at least and the last ROUNDS_CLAIMED rounds of them at most; None where
        unknown or zero."""
        if steps is None or self.schedule is None:
            return None
        last = max(steps[1], steps[0] + 1)
        first = max(steps[0], last - ROUNDS_CLAIMED * self.schedule.round_steps)
        rates = math.sqrt(sum(self.schedule.learning_rate(step) ** 2 for step in range(first, last)))
        return rates if rates > 0 and math.isfinite(rates) else None

    def check(self, tensors: list[torch.Tensor], own_phi: Sequence[torch.Tensor],
              own_delta: Callable[[], Sequence[torch.Tensor]], rounds_ahead: int = 0,
              steps: tuple[int, int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The partner's (phi, Delta) as they count (clipped), or ProtocolError /
        Poisoned / RoundsApart / Refused (see the module doc). ``rounds_ahead``: the
        partner's round minus ours, and ``steps``: the inner steps its Delta covers, as
        it claims them. ``own_delta`` is read only before our first round."""
        n = len(own_phi)
        if len(tensors) != 2 * n:  # each part's shapes and values are checked with the part
            raise ProtocolError(f"expected {2 * n} tensors, got {len(tensors)}")
        delta = self.check_delta(tensors[n:], own_phi, own_delta, rounds_ahead, steps)
        return self.check_phi(tensors[:n], own_phi, own_delta, rounds_ahead), delta

    def check_delta(self, delta: list[torch.Tensor], own_phi: Sequence[torch.Tensor],
                    own_delta: Callable[[], Sequence[torch.Tensor]], rounds_ahead: int = 0,
                    steps: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The partner's Delta alone, as it counts: what a Delta sent ahead of its phi
        must pass before it moves our steps (the same tests as in :meth:`check`)."""
        problem = fit_problem(delta, [p.shape for p in own_phi])
        if problem:
            raise ProtocolError(problem)
        delta_norm = norm(delta)
        if not math.isfinite(delta_norm):
            raise ProtocolError("the update's norm is not finite")
        self._partner_delta_norm = delta_norm
        reference = self.reference(steps)
        if not reference:  # no round yet, or none with a step in it
            self._first_check(delta_norm, "partner's Delta norm", own_delta)
            return delta
        bound = self.max_update_ratio * reference
        if delta_norm > bound:
            why = (f"partner's Delta norm {delta_norm:.3g} is {delta_norm / reference:.1f}x "
                   f"our own {reference:.3g}")
            if rounds_ahead == 0:
                raise Poisoned(why)
            raise RoundsApart(why, rounds_ahead)
        return _scaled_within(delta, delta_norm, self.clip_ratio * reference)

    def check_phi(self, phi: list[torch.Tensor], own_phi: Sequence[torch.Tensor],
                  own_delta: Callable[[], Sequence[torch.Tensor]],
                  rounds_ahead: int = 0) -> list[torch.Tensor]:
        """The partner's phi alone, as it counts (pulled within our scale)."""
        problem = fit_problem(phi, [p.shape for p in own_phi])
        if problem:
            raise ProtocolError(problem)
        apart = tensor_distances(phi, own_phi)
        phi_distance = math.sqrt(sum(d * d for d in apart))
        if not math.isfinite(phi_distance):
            raise ProtocolError("the update's norm is not finite")
        reference = self.reference()
        if not reference:
            self._first_check(phi_distance, "partner's distance from our phi", own_delta)
            self._phi_distances.append(apart)
            return phi
        bound = self.max_update_ratio * reference
        theirs = self._partner_delta_norm if rounds_ahead >= ROUNDS_APART else None
        scale = min(reference, theirs) if theirs else reference
        if (
            phi_distance > DISTANCE_SLACK * self.max_update_ratio * scale
            and abs(rounds_ahead) >= ROUNDS_APART
        ):
            whose = "our" if scale == reference else "its"
            raise RoundsApart(f"partner's phi is {phi_distance / scale:.1f}x {whose} Delta norm away",
                              rounds_ahead)
        # the spread as it was, up to where a partner rounds apart would be declined: pulled in
        # to what counts (1.5x our scale) it read honest replicas of a real run 3-4x closer
        # than they were, and joiners refused honest donors
        keep = min(1.0, DISTANCE_SLACK * bound / phi_distance) if phi_distance > 0 else 1.0
        self._phi_distances.append([d * keep for d in apart])
        return _pulled_within(phi, own_phi, phi_distance, self.clip_ratio * reference)

    def partner_spread(self) -> list[float] | None:
        """Per tensor, the largest distance between our phi and a partner's over the last
        SPREAD_ROUNDS exchanges (None before the first; each capped where a partner rounds
        apart would be declined, so a partner cannot widen it at will): how far apart
        honest replicas of the stage are, for joiners checking a state (state/check.py)."""
        if not self._phi_distances:
            return None
        return [max(column) for column in zip(*self._phi_distances)]

    def _first_check(self, value: float, what: str, own_delta: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Before our first round, our progress so far is the only scale."""
        first = MagnitudeScreen(self.max_update_ratio)
        first.note(norm(own_delta()))
        problem = first.check_only(value, what)
        if problem:
            raise Refused(f"not-ready ({problem})")


def _scaled_within(delta: list[torch.Tensor], delta_norm: float, bound: float) -> list[torch.Tensor]:
    """An accepted Delta larger than ``bound`` counts with norm ``bound``: inside the
    rejection bound an attacker still pulls, but by at most this much per round."""
    if delta_norm <= bound:
        return delta
    return [t * (bound / delta_norm) for t in delta]


def _pulled_within(phi: list[torch.Tensor], own_phi: Sequence[torch.Tensor], phi_distance: float,
                   bound: float) -> list[torch.Tensor]:
    """A partner's phi further than ``bound`` from ours counts as the point at ``bound``
    on the way to it (kept in the partner's dtype and device, as the wire gave it)."""
    if phi_distance <= bound:
        return phi
    keep = bound / phi_distance
    return [(o + (t.to(o.device, torch.float32) - o) * keep).to(t.device, t.dtype) for t, o in zip(phi,
                                                                                                   own_phi)]
