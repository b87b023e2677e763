"""Settings shared across layers."""

from __future__ import annotations

import re

import torch

from swarm_node.errors import ConfigError

# Peak inner learning rates: the paper's for its sizes, tuned on CPU for debug and tiny (mini between).
SUGGESTED_LR = {"debug": 3e-3, "mini": 2e-3, "tiny": 1e-3, "small": 6e-4, "medium": 2e-4, "large": 1.2e-4}


def suggested_lr(model_size: str) -> float:
    return SUGGESTED_LR.get(model_size, 6e-4)


def default_warmup_steps(total_steps: int) -> int:
    """The paper warms up for 1k of 25k steps; keep that share, at least one step."""
    return max(1, min(1000, total_steps // 25))


def resolve_device(name: str) -> str:
    """The torch device for ``--device``: auto picks CUDA, else Apple's MPS, else the CPU.
    ConfigError when the device named is unknown or absent."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "mps":
        if not torch.backends.mps.is_available():
            why = ("this machine has no usable Apple GPU (MPS needs macOS 12.3+)"
                   if torch.backends.mps.is_built() else "this torch build has no MPS support")
            raise ConfigError(f"--device mps was asked for but {why}; use --device cpu")
        return name
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {name} was asked for but torch sees no CUDA device; use --device cpu")
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise ConfigError(f"--device {name} was asked for but torch sees {count} CUDA device(s), "
                          f"cuda:0 to cuda:{count - 1}")
    return name
