"""Settings shared across layers."""

from __future__ import annotations

import torch

# Peak inner learning rates: the paper's for its sizes, tuned on CPU for the small ones.
SUGGESTED_LR = {"debug": 3e-3, "tiny": 1e-3, "small": 6e-4, "medium": 2e-4, "large": 1.2e-4}


def suggested_lr(model_size: str) -> float:
    return SUGGESTED_LR.get(model_size, 6e-4)


def default_warmup_steps(total_steps: int) -> int:
    """The paper warms up for 1k of 25k steps; keep that share, at least one step."""
    return max(1, min(1000, total_steps // 25))


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda[:N]")
    return name
