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
from swarm_node.wire.boundary import BoundaryCodec, encode_code, forward_frame
from swarm_node.wire.frames import encode_frame, finite

# A codec is the run's activation codec by name, or its coded boundary (a code of a few
# values a token, wire/boundary.py): StageWorker.wire_codec. With a coded boundary the
# "targets" a hop carries are the window's token ids (train/worker.py).
Codec = str | BoundaryCodec


# -- on the compute thread: the device work, its results queued towards the host ----------
def outgoing(t: torch.Tensor, codec: Codec) -> tuple[HostCopy, torch.Size]:
    """Activations (or a code) or their gradient as ``codec`` sends them, on their way to
    the host, and their shape."""
    coded = encode_code(t, codec) if isinstance(codec, BoundaryCodec) else encode_activations(t, codec)
    return to_host(coded), t.shape


def forward_to_host(worker: StageWorker, inputs: torch.Tensor, codec: Codec,
                    labels: torch.Tensor | None = None) -> tuple[HostCopy, torch.Size]:
    return outgoing(worker.forward(inputs, labels), codec)


def last_stage_step(worker: StageWorker, hidden, targets, codec: Codec | None, token_inputs=None):
    """Loss, backward and (when due) the inner step, as one unit; the gradient encoded by
    ``codec`` on its way to the host (None for a single-stage run: nothing to send)."""
    loss, grad = worker.forward_backward_last(hidden, targets, token_inputs)
    _, due = step_if_ready(worker)
    return loss, None if codec is None else outgoing(grad, codec)[0], due


def backward_step(worker: StageWorker, inputs, grad_output, codec: Codec | None = None, labels=None):
    grad = worker.backward(inputs, grad_output, labels)
    _, due = step_if_ready(worker)
    return None if codec is None else outgoing(grad, codec)[0], due


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took, measured on the thread that runs it."""
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


# -- on the wire thread ----------------------------------------------------------------------
def encode_forward(header: dict, host: HostCopy, targets: torch.Tensor, codec: Codec = "fp16") -> bytes:
    """The forward request (with a coded boundary, ``targets`` are the window's ids);
    OwnOutputNotFinite if our activations are not finite (checked here, on the host
    copy, so the device is never waited for)."""
    tensors = host.wait()
    for t in tensors:
        if t.is_floating_point() and not finite(t):
            nan = int(torch.isnan(t).sum())
            raise OwnOutputNotFinite(f"{nan} NaN and {int(torch.isinf(t).sum())} infinite values among "
                                     f"{t.numel()} of our {t.dtype} activations")
    if isinstance(codec, BoundaryCodec):
        return forward_frame(header, tensors, targets, codec)
    return encode_frame(header, [*tensors, targets.to(torch.int32)])


def encode_answer(header: dict, host: HostCopy) -> bytes:
    return encode_frame(header, host.wait())


def forward_request(header: dict, hidden: torch.Tensor, targets: torch.Tensor, codec: Codec) -> bytes:
    """A whole forward request in one call (tests, benchmarks)."""
    return encode_forward(header, outgoing(hidden, codec)[0], targets, codec)
