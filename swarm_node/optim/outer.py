"""The NoLoCo / DiLoCo outer step (ALGORITHM.md section 3) as pure functions.

For every member i of a group G (i itself first), per tensor:

    delta_i <- alpha * delta_i + beta * mean_G(Delta_j) - gamma * (phi_i - mean_G(phi_j))
    phi_i   <- phi_i + delta_i          (heavy-ball; the paper's and reference code's form)
    theta_i <- phi_i

with Delta_j = theta_j - phi_j. A group of one is the local-only step; a group of every
worker makes the gamma term vanish and gives DiLoCo.

Overlapped (ALGORITHM.md section 3.1): at the boundary a worker snapshots theta_s and
sends (phi_i, Delta_i = theta_s - phi_i), keeps taking inner steps, and when the group's
payloads are in applies the same update to phi and carries the progress made meanwhile
onto it: theta_i <- phi_i(new) + (theta_i - theta_s). With no steps in between it is the
blocking step exactly. A group's Delta that lands ahead of its phi moves theta_s (and
theta with it) to the group's Delta step at once; phi follows when it lands. With
``nesterov=True`` the step looks ahead: phi_i <- phi_i + g + alpha * delta_i, where g is
the bracketed update (torch SGD's Nesterov form with lr folded into beta).

Group means are accumulated in float64 (on the CPU for MPS tensors, which have no
float64): the sum of a few float32 tensors is then exact in practice, so every member
of a group gets bit-identical means whatever order it lists the members in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class OuterHyper:
    alpha: float  # outer momentum
    beta: float  # outer learning rate
    gamma: float  # pull towards the group's mean phi (NoLoCo); ignored for a group of one
    nesterov: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.alpha < 1:
            raise ValueError(f"outer momentum alpha must be in [0, 1), got {self.alpha}")
        if self.beta <= 0:
            raise ValueError(f"outer learning rate beta must be positive, got {self.beta}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be non-negative, got {self.gamma}")


def group_mean(tensors: Tensors) -> torch.Tensor:
    """Mean of the members' tensors, accumulated in float64, returned in float32."""
    if len(tensors) == 0:
        raise ValueError("a group needs at least one member")
    device = tensors[0].device
    total = torch.zeros(tensors[0].shape, dtype=torch.float64, device=_float64_device(device))
    for t in tensors:
        if t.shape != total.shape:
            raise ValueError(f"group members disagree on shape: {tuple(t.shape)} vs {tuple(total.shape)}")
        total += t.to(total.device).to(torch.float64)
    return (total / len(tensors)).to(device=device, dtype=torch.float32)


def _float64_device(device: torch.device) -> torch.device:
    """Where to accumulate in float64. MPS has no float64: its sums go to the CPU, which
    gives an Apple peer the same bits as its CPU and CUDA partners (a float32 sum
    would not, and would depend on the order of the members)."""
    return torch.device("cpu") if device.type == "mps" else device


def _outer_update_tensor(phi: torch.Tensor, momentum: torch.Tensor, group_phi: Tensors, group_delta: Tensors,
                         alpha: float, beta: float, gamma: float, nesterov: bool):
    if len(group_phi) != len(group_delta):
        raise ValueError(f"{len(group_phi)} phi tensors but {len(group_delta)} delta tensors")
    phi32 = phi.float()
    update = beta * group_mean(group_delta)
    if len(group_phi) > 1 and gamma != 0.0:
        update -= gamma * (phi32 - group_mean(group_phi))
    new_momentum = alpha * momentum.float() + update
    step = update + alpha * new_momentum if nesterov else new_momentum
    return (phi32 + step).to(phi.dtype), new_momentum.to(momentum.dtype)


def outer_update(phi, momentum, group_phi, group_delta, *, alpha: float, beta: float, gamma: float,
                 nesterov: bool = False):
    """Return ``(new_phi, new_momentum)``; inputs are not modified. The new theta is new_phi.

    ``phi`` and ``momentum`` are the caller's tensors; ``group_phi`` / ``group_delta``
    hold one entry per group member, the caller's own first. Accepts either single
    tensors (members are tensors) or lists of tensors (members are lists, one tensor per
    parameter), returning the same shape of result.
    """
    if isinstance(phi, torch.Tensor):
        return _outer_update_tensor(phi, momentum, group_phi, group_delta, alpha, beta, gamma, nesterov)
    if len(phi) != len(momentum) or any(len(member) != len(phi) for member in (*group_phi, *group_delta)):
        raise ValueError("phi, momentum and every group member must list the same number of tensors")
    results = [
        _outer_update_tensor(phi[k], momentum[k], [m[k] for m in group_phi], [m[k] for m in group_delta],
                             alpha, beta, gamma, nesterov)
        for k in range(len(phi))
    ]
    return [r[0] for r in results], [r[1] for r in results]


class SlowWeights:
    """A worker's outer state: phi (the weights after the last outer step) and the
    outer momentum buffer, kept in float32 beside the live parameters theta."""

    def __init__(self, params: Sequence[torch.nn.Parameter], hyper: OuterHyper,
                 device: torch.device | None = None):
        self.params = list(params)
        self.hyper = hyper
        self.phi = [p.detach().to(device=device, dtype=torch.float32, copy=True) for p in self.params]
        self.momentum = [torch.zeros_like(t) for t in self.phi]

    @torch.no_grad()
    def deltas(self) -> list[torch.Tensor]:
        """Delta = theta - phi, the progress since the last outer step."""
        return [p.detach().float().to(f.device) - f for p, f in zip(self.params, self.phi)]

    @torch.no_grad()
    def apply(self, group_phi: Sequence[Tensors], group_delta: Sequence[Tensors]) -> None:
        """Run the outer update with this worker first in the group, then set theta = phi."""
        h = self.hyper
        self.phi, self.momentum = outer_update(self.phi, self.momentum, group_phi, group_delta,
                                               alpha=h.alpha, beta=h.beta, gamma=h.gamma, nesterov=h.nesterov)
        for p, f in zip(self.params, self.phi):
            p.copy_(f.to(device=p.device, dtype=p.dtype))

    @torch.no_grad()
    def start_overlapped(self, group_phi: Sequence[Tensors] | None = None,
                         group_delta: Sequence[Tensors] | None = None) -> list[torch.Tensor]:
        """At an overlapped round's boundary, once its payload (phi, ``deltas()``) is
        taken: theta moves to where the local-only outer step would put it (phi and the
        momentum stay), so the inner steps beside the exchange start from there
        (ALGORITHM.md 3.1). Returns that point, as theta holds it, for
        :meth:`apply_overlapped`. The simulator's analysis may pass a group's payloads
        (ours first) to start from that group's outer step instead."""
        h = self.hyper
        if group_phi is None or group_delta is None:
            group_phi, group_delta = [self.phi], [self.deltas()]
        local_phi, _ = outer_update(self.phi, self.momentum, group_phi, group_delta,
                                    alpha=h.alpha, beta=h.beta, gamma=h.gamma, nesterov=h.nesterov)
        for p, f in zip(self.params, local_phi):
            p.copy_(f.to(device=p.device, dtype=p.dtype))
        return [p.detach().float().to(f.device, copy=True) for p, f in zip(self.params, self.phi)]

    @torch.no_grad()
    def land_deltas(self, group_delta: Sequence[Tensors], theta_start: Tensors) -> list[torch.Tensor]:
        """The group's Delta in ahead of its phi (ours first): theta moves by the
        difference between the group's Delta step and ``theta_start`` (phi, the momentum
        and the gamma pull wait for the phi), keeping the progress made since. Returns
        the new start for :meth:`apply_overlapped`. If the partners' phi never comes,
        :meth:`apply_overlapped` of our own payload from that start is the local-only
        step with the progress kept, as it would have been without this."""
        h = self.hyper
        start, _ = outer_update(self.phi, self.momentum, [self.phi] * len(group_delta), group_delta,
                                alpha=h.alpha, beta=h.beta, gamma=h.gamma, nesterov=h.nesterov)
        for p, old, new in zip(self.params, theta_start, start):
            progress = p.detach().float().to(new.device) - old
            p.copy_((new + progress).to(device=p.device, dtype=p.dtype))
        return start

    @torch.no_grad()
    def apply_overlapped(self, group_phi: Sequence[Tensors], group_delta: Sequence[Tensors],
                         theta_start: Tensors) -> None:
        """The outer update of the group's payloads taken at the boundary (ours first),
        with the inner progress made since :meth:`start_overlapped` kept:
        theta <- phi_new + (theta - theta_start)."""
        h = self.hyper
        self.phi, self.momentum = outer_update(self.phi, self.momentum, group_phi, group_delta,
                                               alpha=h.alpha, beta=h.beta, gamma=h.gamma, nesterov=h.nesterov)
        for p, f, start in zip(self.params, self.phi, theta_start):
            progress = p.detach().float().to(f.device) - start
            p.copy_((f + progress).to(device=p.device, dtype=p.dtype))

    @torch.no_grad()
    def local_close(self, own_phi: Tensors, own_delta: Tensors,
                    theta_start: Tensors) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                   list[torch.Tensor]]:
        """(theta, phi, momentum) as :meth:`apply_overlapped` of our own payload alone
        (the local-only close of an overlapped round) would leave them, without changing
        anything: the state of a replica that closed the round alone now."""
        h = self.hyper
        phi, momentum = outer_update(self.phi, self.momentum, [own_phi], [own_delta], alpha=h.alpha,
                                     beta=h.beta,
                                     gamma=h.gamma, nesterov=h.nesterov)
        theta = [f + (p.detach().float().to(f.device) - start) for p, f, start in zip(self.params, phi,
                                                                                      theta_start)]
        return theta, phi, momentum

    def apply_local(self) -> None:
        """The group-of-one step, used when no partner can be had."""
        self.apply([self.phi], [self.deltas()])

    def state_dict(self) -> dict:
        return {"phi": self.phi, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        self.phi = [t.clone() for t in state["phi"]]
        self.momentum = [t.clone() for t in state["momentum"]]
