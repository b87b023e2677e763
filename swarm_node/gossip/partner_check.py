"""What a partner's (phi, Delta) must pass before it is averaged in.

First it must fit our stage: as many tensors as ours, the same shapes, floating point,
finite. Then it must be in scale with our own progress: its Delta's norm, and its
phi's distance from ours, at most ``max_update_ratio`` times our scale, and it counts
with at most ``clip_ratio`` times our scale (its Delta scaled down, its phi's pull
shortened).

Our scale is built from our own Deltas only, each stretched to a whole round (a round
taken early covers fewer steps): the larger of their recent median and the latest, so
that a rising learning rate in warm-up raises it at once. What partners send never
moves it. (It used to take in every accepted partner Delta, so a poisoner inside the
bound raised the bound round by round: a constant-offset attacker at 5x was accepted
in 42 of 43 exchanges, until the two honest nodes of its stage rejected each other.)
Distances only compare with our own Delta norms too: right after init or an exchange
honest partners sit almost on top of each other, and a median of such distances would
make the next honest partner look like an attack.

Before our first round the only scale we have is our progress so far, and a partner a
round ahead of a node in warm-up (or started late) is out of it honestly: such an
exchange is declined (Refused), not punished. After it, an update out of scale is
OutOfScale: the exchange tells a partner at another round (declined) from a poisoner
(not paired with for half an hour, net/guard.py).

Everything here runs on the compute thread, the screens included."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from swarm_node.errors import ProtocolError
from swarm_node.gossip.pairing import Refused
from swarm_node.train.screen import MagnitudeScreen
from swarm_node.wire.messages import finite


class OutOfScale(ProtocolError):
    """A well-formed update too large against our own progress: poisoned, or a partner
    rounds apart from us (the caller tells which by the rounds)."""


def norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


def distance(theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor]) -> float:
    """The partner's tensors were decoded on the CPU; ours live on the training device."""
    return math.sqrt(sum(float((t.to(o.device, torch.float32) - o).pow(2).sum()) for t, o in zip(theirs, ours)))


def fit_problem(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> str | None:
    """Why a partner's (phi, Delta) list does not fit a stage of ``shapes``, or None."""
    expected = list(shapes) * 2
    if len(tensors) != len(expected):
        return f"expected {len(expected)} tensors, got {len(tensors)}"
    for t, shape in zip(tensors, expected):
        if t.shape != shape or not t.dtype.is_floating_point:
            return f"tensor of shape {tuple(t.shape)} / {t.dtype} does not fit {tuple(shape)}"
        if not finite(t):
            return "non-finite values"
    return None


# Honest phi distances spread wider than Delta norms: partners drift apart between their
# exchanges, and further while a poisoner inside the bound pulls each its own way (up to
# 3x our Delta norm measured in the simulator, against 1.3x for Delta norms). A phi far
# off pulls by at most clip_ratio times our scale anyway (below).
DISTANCE_SLACK = 2.0


class PartnerCheck:
    def __init__(self, max_update_ratio: float, clip_ratio: float = 1.5):
        if clip_ratio <= 1:
            raise ValueError("clip_ratio must be above 1")
        self.max_update_ratio = max_update_ratio
        self.clip_ratio = min(clip_ratio, max_update_ratio)
        self.max_distance_ratio = DISTANCE_SLACK * max_update_ratio
        self._own = MagnitudeScreen(max_update_ratio)  # only ever fed our own Delta norms
        self._latest: float | None = None

    def note_own_delta(self, own_delta: Sequence[torch.Tensor], round_fraction: float = 1.0) -> float:
        """At the start of each of our rounds: our own Delta norm, over ``round_fraction``
        of a round's inner steps, is the scale partners are held to. Returns the norm."""
        value = norm(own_delta)
        stretched = value / min(1.0, max(round_fraction, 0.1))
        if math.isfinite(stretched):
            self._own.note(stretched)
            self._latest = stretched
        return value

    def reference(self) -> float | None:
        """The scale partners are held to now."""
        median = self._own.reference()
        return None if median is None or self._latest is None else max(median, self._latest)

    def check(self, tensors: list[torch.Tensor], own_phi: Sequence[torch.Tensor],
              own_delta: Callable[[], Sequence[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The partner's (phi, Delta), clipped to ``clip_ratio`` times our scale, or
        ProtocolError / OutOfScale / Refused (see the module doc). ``own_delta`` is read
        only before our first round."""
        problem = fit_problem(tensors, [p.shape for p in own_phi])
        if problem:
            raise ProtocolError(problem)
        n = len(own_phi)
        phi, delta = tensors[:n], tensors[n:]
        delta_norm, phi_distance = norm(delta), distance(phi, own_phi)
        reference = self.reference()
        if not reference:  # no round yet, or none with a step in it
            first = MagnitudeScreen(self.max_update_ratio)
            first.note(norm(own_delta()))
            problem = (first.check_only(delta_norm, "partner's Delta norm")
                       or first.check_only(phi_distance, "partner's distance from our phi"))
            if problem:
                raise Refused(f"not-ready ({problem})")
            return phi, delta
        for value, what, ratio in ((delta_norm, "partner's Delta norm", self.max_update_ratio),
                                   (phi_distance, "partner's distance from our phi", self.max_distance_ratio)):
            if not math.isfinite(value):
                raise ProtocolError(f"{what} is not finite")
            if value > ratio * reference:
                raise OutOfScale(f"{what} {value:.3g} is {value / reference:.1f}x our own Delta norm {reference:.3g}")
        return (_pulled_within(phi, own_phi, phi_distance, self.clip_ratio * reference),
                _scaled_within(delta, delta_norm, self.clip_ratio * reference))


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
    return [(o + (t.to(o.device, torch.float32) - o) * keep).to(t.device, t.dtype) for t, o in zip(phi, own_phi)]
