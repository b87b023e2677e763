"""``--compile``: the stage's decoder blocks through ``torch.compile``, a peer-local choice
(the math is the same; the run spec does not carry it).

Each block is compiled in place (``nn.Module.compile``), as torchtitan does: the blocks
of a stage are alike, so torch compiles one block's graph and every other block reuses
it, and the compile time does not grow with the stage's depth. Parameter names, the
state dict and checkpoints are unchanged. The embedding, the final norm and the
chunked loss (model/loss.py) stay eager.

The worker runs a block in two ways, and torch.compile makes a graph for each: without
autograd (``StageWorker.forward``, non-last stages) and with it, the forward that the
recompute-on-backward design re-runs when a gradient comes back (``backward``,
``forward_backward_last``), with its backward graph. All of them are compiled here, at
start-up, on a dummy micro-batch of the run's shape under the worker's autocast, so
that the first real micro-batch does not wait out a compilation beyond its hop
deadline (30 s); the time it took is logged and kept as ``StageWorker.compile_s``. The
dummy micro-batch leaves no trace: gradients are cleared and no counter moves.

Importing torch._dynamo costs seconds and ~800 modules, which is why this happens only
when asked.
"""

from __future__ import annotations

import logging
import time

import torch

from swarm_node.errors import SwarmError
from swarm_node.model.stages import PipelineStage
from swarm_node.train.device import is_out_of_memory
from swarm_node.train.worker import Pullback, StageWorker

log = logging.getLogger(__name__)


class CompileFailed(SwarmError):
    """torch.compile could not compile the stage; the message says what to change."""


def compile_blocks(stage: PipelineStage) -> int:
    """Compile every decoder block of ``stage`` in place (lazily: at its first call); returns
    how many."""
    for block in stage.model.layers.values():
        block.compile(dynamic=False)
    return len(stage.model.layers)


def uncompile_blocks(stage: PipelineStage) -> None:
    """Back to eager blocks (for side-by-side measurements: bench/gpu_step)."""
    for block in stage.model.layers.values():
        block._compiled_call_impl = None


def compile_stage(worker: StageWorker) -> float:
    """Compile the worker's blocks and warm them up; returns the seconds it took, also
    kept as ``worker.compile_s``."""
    started = time.perf_counter()
    blocks = compile_blocks(worker.stage)
    try:
        warm_up(worker)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise  # the node explains it as any out-of-memory failure
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CompileFailed(f"torch.compile of stage {worker.stage.stage_index} on {worker.device} failed "
                            f"({type(exc).__name__}: {first_line}); run without --compile") from exc
    seconds = worker.compile_s = time.perf_counter() - started
    log.info("torch.compile: the %d block%s of stage %d compiled for %d x %d-token micro-batches in %.1f s",
             blocks,
             "s" if blocks != 1 else "", worker.stage.stage_index, worker.spec.batch_size,
             worker.spec.seq_len,
             seconds)
    return seconds


def warm_up(worker: StageWorker) -> None:
    """Each way the worker runs its stage, once, on a dummy micro-batch of the run's shape."""
    batch, seq_len, hidden = worker.spec.batch_size, worker.spec.seq_len, worker.model_config.hidden_size
    device, stage = worker.device, worker.stage
    if worker.is_first:
        inputs = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    else:
        inputs = torch.zeros(batch, seq_len, hidden, device=device)
    targets = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    try:
        if not worker.is_last:
            with torch.no_grad(), worker.autocast():
                stage(inputs)
        x = inputs if worker.is_first else inputs.clone().requires_grad_(True)
        with worker.autocast():
            out = stage(x, targets) if worker.is_last else stage(x)
        if worker.is_last:
            out.backward()
        else:
            Pullback.apply(out.float(), torch.zeros(out.shape, device=device)).backward()
    finally:
        for p in worker.params:
            p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
