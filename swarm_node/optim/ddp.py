"""The DDP baseline's one piece of math: average gradients across the workers of a stage."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def average_gradients(worker_params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
    """Replace every worker's gradient by the mean over workers (same parameter order).
    Frozen parameters (requires_grad False, the ablation of a frozen embedding) have none."""
    if len(worker_params) < 2:
        return
    for group in zip(*worker_params, strict=True):
        if not any(p.requires_grad for p in group):
            continue
        grads = [p.grad for p in group]
        if any(g is None for g in grads):
            raise ValueError("every worker must have a gradient for every parameter before averaging")
        mean = torch.stack(grads).mean(dim=0)
        for g in grads:
            g.copy_(mean)
