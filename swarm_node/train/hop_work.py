"""What a hop computes and encodes, off the event loop (train/pipeline.py runs these
and moves their bytes).

On the compute thread: the device work of one micro-batch at this stage (the forward;
the loss and backward at the last stage; the backward with the gradient that came
back elsewhere; the inner step when one is due), its results queued towards the host
in the run's activation codec (train/host_copy.py), so the device is never waited
for. On the wire thread: the forward request and the gradient answer encoded, our
own activations checked finite first (a node whose weights diverged sends nothing
that the next stage would count against it)."""

from __future__ import annotations

import time

import torch

from swarm_node.errors import OwnOutputNotFinite
from swarm_node.train.host_copy import HostCopy, to_host
from swarm_node.train.rounds import step_if_ready
from swarm_node.train.worker import StageWorker
from swarm_node.wire.activations import encode_activations
from swarm_node.wire.frames import encode_frame, finite


# -- on the compute thread: the device work, its results queued towards the host ----------
def outgoing(t: torch.Tensor, codec: str) -> tuple[HostCopy, torch.Size]:
    """Activations or their gradient as ``codec`` sends them, on their way to the host,
    and their shape."""
    return to_host(encode_activations(t, codec)), t.shape


def forward_to_host(worker: StageWorker, inputs: torch.Tensor, codec: str) -> tuple[HostCopy, torch.Size]:
    return outgoing(worker.forward(inputs), codec)


def last_stage_step(worker: StageWorker, hidden, targets, codec: str | None, token_inputs=None):
    """Loss, backward and (when due) the inner step, as one unit; the gradient encoded by
    ``codec`` on its way to the host (None for a single-stage run: nothing to send)."""
    loss, grad = worker.forward_backward_last(hidden, targets, token_inputs)
    _, due = step_if_ready(worker)
    return loss, None if codec is None else outgoing(grad, codec)[0], due


def backward_step(worker: StageWorker, inputs, grad_output, codec: str | None = None):
    grad = worker.backward(inputs, grad_output)
    _, due = step_if_ready(worker)
    return None if codec is None else outgoing(grad, codec)[0], due


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took, measured on the thread that runs it."""
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


# -- on the wire thread ----------------------------------------------------------------------
def encode_forward(header: dict, host: HostCopy, targets: torch.Tensor) -> bytes:
    """The forward request; OwnOutputNotFinite if our activations are not finite (checked
    here, on the host copy, so the device is never waited for)."""
    tensors = host.wait()
    for t in tensors:
        if t.is_floating_point() and not finite(t):
            nan = int(torch.isnan(t).sum())
            raise OwnOutputNotFinite(
                f"{nan} NaN and {int(torch.isinf(t).sum())} infinite values among {t.numel()} "
                f"of our {t.dtype} activations"
            )
    return encode_frame(header, [*tensors, targets.to(torch.int32)])


def encode_answer(header: dict, host: HostCopy) -> bytes:
    return encode_frame(header, host.wait())


def forward_request(header: dict, hidden: torch.Tensor, targets: torch.Tensor, codec: str) -> bytes:
    """A whole forward request in one call (tests, benchmarks)."""
    return encode_forward(header, outgoing(hidden, codec)[0], targets)
