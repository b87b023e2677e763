"""What a partner's (phi, Delta) must pass before it is averaged in.

First it must fit our stage: as many tensors as ours, the same shapes, floating point,
finite. Then it must be in scale with our own progress: its Delta's norm, and its
phi's distance from ours, at most ``max_update_ratio`` times the median of our own
recent Delta norms (train/screen.py). Distances only compare with our own Delta norms:
right after init or an exchange honest partners sit almost on top of each other, and
a median of such distances would make the next honest partner look like an attack.

Before our first round the only scale we have is our progress so far, and a partner a
round ahead of a node in warm-up (or started late) is out of it honestly: such an
exchange is declined (Refused), not punished. After it, an update out of scale is a
ProtocolError: the round goes on without it and the sender is banned.

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


class PartnerCheck:
    def __init__(self, max_update_ratio: float):
        self.max_update_ratio = max_update_ratio
        self._delta_screen = MagnitudeScreen(max_update_ratio)
        self._distance_screen = MagnitudeScreen(max_update_ratio)

    def note_own_delta(self, own_delta: Sequence[torch.Tensor]) -> float:
        """At the start of each of our rounds: our own Delta norm is the scale partners
        are held to. Returns it."""
        value = norm(own_delta)
        self._delta_screen.note(value)
        self._distance_screen.note(value)
        return value

    def check(self, tensors: list[torch.Tensor], own_phi: Sequence[torch.Tensor],
              own_delta: Callable[[], Sequence[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The partner's (phi, Delta), or ProtocolError / Refused (see the module doc).
        ``own_delta`` is read only before our first round."""
        problem = fit_problem(tensors, [p.shape for p in own_phi])
        if problem:
            raise ProtocolError(problem)
        n = len(own_phi)
        phi, delta = tensors[:n], tensors[n:]
        delta_norm, phi_distance = norm(delta), distance(phi, own_phi)
        if self._delta_screen.reference() is None:
            first = MagnitudeScreen(self.max_update_ratio)
            first.note(norm(own_delta()))
            problem = (first.check_only(delta_norm, "partner's Delta norm")
                       or first.check_only(phi_distance, "partner's distance from our phi"))
            if problem:
                raise Refused(f"not-ready ({problem})")
        else:
            problem = (self._delta_screen.check(delta_norm, "partner's Delta norm")
                       or self._distance_screen.check_only(phi_distance, "partner's distance from our phi"))
            if problem:
                raise OutOfScale(problem)
        return phi, delta
