"""Evaluation shared by the simulator and the swarm: validation loss along fixed or
random paths, a consensus model, and the spread of weights across the workers of a stage.

On an accelerator a validation batch goes through in parts of at most ``rows`` windows,
under the device's training autocast; a part that runs out of memory is split in two
and tried again, so a batch size chosen for the CPU still fits a card."""

from __future__ import annotations

import contextlib
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
    hidden = tokens = inputs.to(device)
    for stage in path:
        hidden = stage(hidden, targets.to(device) if stage.is_last else None, tokens=tokens)
    return float(hidden)


class BatchParts:
    """Splits validation batches into parts of at most ``rows`` windows, halving ``rows``
    (for this and every later batch) when a part runs out of device memory."""

    def __init__(self, rows: int | None = None, autocast_dtype: torch.dtype | None = None):
        self.rows = rows
        self.autocast_dtype = autocast_dtype

    def loss_sum(self, path: Sequence[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor,
                 device: torch.device | str) -> float:
        """The summed loss of the batch's windows (mean loss x windows)."""
        rows = self.rows or len(inputs)
        while True:
            try:
                return sum(self._part(path, inputs[i:i + rows], targets[i:i + rows], device)
                           for i in range(0, len(inputs), rows))
            except torch.OutOfMemoryError:
                if rows == 1:
                    raise
                rows = self.rows = max(1, min(rows, len(inputs)) // 2)
                torch.cuda.empty_cache()

    def _part(self, path, inputs, targets, device) -> float:
        device = torch.device(device)
        cast = contextlib.nullcontext() if self.autocast_dtype is None else \
            torch.autocast(device.type, dtype=self.autocast_dtype)
        with cast:
            return _path_loss(path, inputs, targets, device) * len(inputs)


@torch.no_grad()
def path_val_loss(stages: Sequence[PipelineStage], data: TokenWindows, *, batch_size: int, max_batches: int,
                  device: torch.device | str = "cpu", on_batch: Callable[[], None] | None = None,
                  parts: BatchParts | None = None) -> float:
    """Mean validation loss of the model the ``stages`` form, over the first ``max_batches``
    validation batches; ``on_batch`` is called after each (for progress displays, and to
    stop an evaluation by raising). ``parts``: how a batch is split on the device (default:
    whole, in fp32)."""
    parts = parts or BatchParts()
    total, count = 0.0, 0
    with _evaluating(stages):
        for inputs, targets in data.val_batches(batch_size, max_batches):
            total += parts.loss_sum(stages, inputs, targets, device)
            count += len(inputs)
            if on_batch is not None:
                on_batch()
    return total / count


@torch.no_grad()
def random_paths_val_loss(stage_workers: Sequence[Sequence[PipelineStage]], data: TokenWindows, *,
                          batch_size: int,
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
def average_states(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state dicts of one stage (fp32 sums, each tensor's own dtype)."""
    return {name: torch.stack([s[name].float() for s in states]).mean(0).to(value.dtype)
            for name, value in states[0].items()}


@torch.no_grad()
def weight_spread(stages: Sequence[PipelineStage]) -> float:
    """RMS over all parameter elements of the standard deviation across ``stages``."""
    return state_spread([dict(s.named_parameters()) for s in stages])


@torch.no_grad()
def state_spread(states: Sequence[dict[str, torch.Tensor]]) -> float:
    """weight_spread of the stages these state dicts (or named parameters) describe."""
    if len(states) < 2:
        return 0.0
    sq_sum, numel = 0.0, 0
    for name in states[0]:
        stacked = torch.stack([s[name].detach().float() for s in states])
        sq_sum += float(stacked.var(dim=0, unbiased=False).sum())
        numel += stacked[0].numel()
    return (sq_sum / numel) ** 0.5
