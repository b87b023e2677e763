"""The inner optimizer: Adam/AdamW with gradient clipping over the worker's own stage
and a linear warm-up + cosine decay schedule that follows the worker's own step
counter (so a late joiner continues the schedule where its stage is)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InnerHyper:
    lr: float = 6e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # <= 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and total_steps >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_at(step: int, hyper: InnerHyper) -> float:
    """Learning rate for inner step ``step`` (0-based)."""
    if step < hyper.warmup_steps:
        return hyper.lr * (step + 1) / hyper.warmup_steps
    decay_steps = max(1, hyper.total_steps - hyper.warmup_steps)
    progress = min(1.0, (step - hyper.warmup_steps) / decay_steps)
    floor = hyper.lr * hyper.min_lr_ratio
    return floor + 0.5 * (hyper.lr - floor) * (1 + math.cos(math.pi * progress))


class InnerOptimizer:
    def __init__(self, params: Iterable[torch.nn.Parameter], hyper: InnerHyper):
        self.params = [p for p in params if p.requires_grad]
        self.hyper = hyper
        self.step_count = 0
        self.optimizer = torch.optim.AdamW(self.params, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                                           weight_decay=hyper.weight_decay, foreach=True)

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.hyper)

    def step(self) -> float:
        """Clip, step at the scheduled lr, clear gradients; returns the pre-clip grad norm."""
        if self.hyper.clip_norm > 0:
            # foreach=None: torch takes its foreach kernels on CPU and CUDA and refuses
            # foreach=True on devices without them (MPS).
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.hyper.clip_norm, foreach=None))
        else:
            norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
