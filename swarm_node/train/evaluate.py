"""Evaluation shared by the simulator and the swarm: validation loss along fixed or
random paths, a consensus model, and the spread of weights across the workers of a stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from swarm_node.data.dataset import TokenWindows
from swarm_node.model.stages import PipelineStage


@contextmanager
def _evaluating(stages: Sequence[PipelineStage]) -> Iterator[None]:
    """The stages in eval mode for the block, each back in its own mode after it."""
    was_training = [s.training for s in stages]
    for s in stages:
        s.eval()
    try:
        yield
    finally:
        for s, mode in zip(stages, was_training):
            s.train(mode)


def _path_loss(path: Sequence[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor,
               device: torch.device | str) -> float:
    hidden = inputs.to(device)
    for stage in path:
        hidden = stage(hidden, targets.to(device) if stage.is_last else None)
    return float(hidden)


@torch.no_grad()
def path_val_loss(stages: Sequence[PipelineStage], data: TokenWindows, *, batch_size: int, max_batches: int,
                  device: torch.device | str = "cpu", on_batch: Callable[[], None] | None = None) -> float:
    """Mean validation loss of the model the ``stages`` form, over the first ``max_batches``
    validation batches; ``on_batch`` is called after each (for progress displays)."""
    total, count = 0.0, 0
    with _evaluating(stages):
        for inputs, targets in data.val_batches(batch_size, max_batches):
            total += _path_loss(stages, inputs, targets, device) * len(inputs)
            count += len(inputs)
            if on_batch is not None:
                on_batch()
    return total / count


@torch.no_grad()
def random_paths_val_loss(stage_workers: Sequence[Sequence[PipelineStage]], data: TokenWindows, *, batch_size: int,
                          max_batches: int, paths_per_batch: int, seed: int,
                          device: torch.device | str = "cpu") -> float:
    """Mean validation loss over random paths: each batch goes through ``paths_per_batch``
    paths, each a random worker of every stage (``stage_workers[s]``: the workers of
    stage s), drawn from ``seed`` alone, so every method of a comparison is evaluated on
    the same draws. A swarm routes every micro-batch this way; the fixed paths "worker
    r at every stage" are only the paths a run with fixed routing trained."""
    rng = np.random.default_rng([seed, 0x70617468])
    total, count = 0.0, 0
    with _evaluating([s for workers in stage_workers for s in workers]):
        for inputs, targets in data.val_batches(batch_size, max_batches):
            for _ in range(paths_per_batch):
                path = [workers[int(rng.integers(len(workers)))] for workers in stage_workers]
                total += _path_loss(path, inputs, targets, device) * len(inputs)
                count += len(inputs)
    return total / count


def val_batch_count(data: TokenWindows, batch_size: int, max_batches: int) -> int:
    """How many batches ``path_val_loss`` evaluates."""
    return min(max_batches, -(-data.num_val_windows // batch_size))


@torch.no_grad()
def average_into(target: PipelineStage, sources: Sequence[PipelineStage]) -> PipelineStage:
    """Set ``target``'s weights to the element-wise mean of ``sources``'."""
    named = [dict(s.named_parameters()) for s in sources]
    for name, param in target.named_parameters():
        param.copy_(torch.stack([n[name].detach().float() for n in named]).mean(0).to(param.dtype))
    return target


@torch.no_grad()
def weight_spread(stages: Sequence[PipelineStage]) -> float:
    """RMS over all parameter elements of the standard deviation across ``stages``."""
    if len(stages) < 2:
        return 0.0
    sq_sum, numel = 0.0, 0
    for group in zip(*(s.parameters() for s in stages)):
        stacked = torch.stack([p.detach().float() for p in group])
        sq_sum += float(stacked.var(dim=0, unbiased=False).sum())
        numel += stacked[0].numel()
    return (sq_sum / numel) ** 0.5
