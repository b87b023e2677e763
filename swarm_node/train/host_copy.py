"""Tensors between the training device and the host memory the wire reads, moved
without stopping the compute thread.

On CUDA, ``tensor.cpu()`` waits for every kernel queued before it and then copies
through pageable memory: the compute thread, which queues the next micro-batch's
kernels, sat idle for the whole forward of the last one. ``to_host`` instead queues the
copy on a stream of its own, into pinned memory, behind the work that made the tensors,
and returns at once; the wire thread (train/compute.py) waits for it there. The other
way, the wire thread pins what it decoded (``pinned_for``) so that the compute thread's
copy to the device is queued, not waited for. On the CPU both are no-ops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class HostCopy:
    """Tensors on their way to host memory; ``wait()`` hands them over once they are there."""
    tensors: list[torch.Tensor]
    ready: torch.cuda.Event | None = None

    def wait(self) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL while it waits
        return self.tensors


def to_host(tensors: Sequence[torch.Tensor]) -> HostCopy:
    """On the compute thread: copies of ``tensors`` in host memory, queued behind the
    work that computes them (CUDA), or the tensors themselves (already on the host)."""
    tensors = [t.detach() for t in tensors]
    if not tensors or tensors[0].device.type != "cuda":
        return HostCopy([t.cpu() for t in tensors])  # the CPU: no copy; MPS: a waited copy
    device = tensors[0].device
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t,
                                                                          non_blocking=True) for t in tensors]
        ready = torch.cuda.Event()
        ready.record(stream)
    for t in tensors:
        t.record_stream(stream)  # the allocator must not hand t's memory out before the copy has read it
    return HostCopy(out, ready)


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """On the wire thread: ``t`` in pinned memory when it is bound for a CUDA device, so
    its copy there (``.to(device, non_blocking=True)``) does not hold the compute thread."""
    return t.pin_memory() if device.type == "cuda" else t
