"""What the training device is and how we compute on it: its name, compute capability
and memory, the autocast precision, and out-of-memory errors turned into one line
that says what to change."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from swarm_node.errors import SwarmError
from swarm_node.model.config import model_config
from swarm_node.model.memory import StageMemory, estimate_stage_memory, format_bytes
from swarm_node.spec import RunSpec

log = logging.getLogger(__name__)

# bf16 tensor cores arrived with Ampere (compute capability 8.0). Older cards (T4 7.5,
# V100 7.0, GTX 10xx/16xx, RTX 20xx) have none, so bf16 matmuls take slow paths there,
# yet torch.cuda.is_bf16_supported() answers True for them unless told not to count
# emulation: we ask the capability directly.
BF16_MIN_CAPABILITY = (8, 0)

# Messages of out-of-memory failures that are not torch.OutOfMemoryError in every
# torch release: the MPS allocator's and the CPU allocator's.
_OOM_MESSAGES = ("MPS backend out of memory", "DefaultCPUAllocator: can't allocate memory")


class OutOfMemory(SwarmError):
    """The device ran out of memory; the message names the need and what to change."""


@dataclass(frozen=True)
class DeviceFacts:
    device: str  # as torch names it: cpu, cuda:0, mps
    name: str
    capability: tuple[int, int] | None  # CUDA compute capability
    total_memory_bytes: int | None

    def describe(self) -> str:
        parts = [self.name]
        if self.capability is not None:
            parts.append(f"compute capability {self.capability[0]}.{self.capability[1]}")
        if self.total_memory_bytes:
            parts.append(format_bytes(self.total_memory_bytes))
        return f"{self.device} ({', '.join(parts)})"


def device_facts(device: torch.device | str) -> DeviceFacts:
    """Name, compute capability and memory of ``device``; asks the driver (CUDA, MPS)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return DeviceFacts(f"cuda:{index}", properties.name, tuple(torch.cuda.get_device_capability(index)),
                           properties.total_memory)
    if device.type == "mps":
        # Metal's recommended working-set size: what the MPS allocator lets us use by default.
        return DeviceFacts("mps", "Apple GPU (MPS)", None, torch.mps.recommended_max_memory())
    return DeviceFacts(str(device), "CPU", None, _physical_memory_bytes())


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def autocast_dtype(facts: DeviceFacts) -> torch.dtype | None:
    """bf16 autocast on CUDA cards with native bf16 (Ampere and newer); fp32 elsewhere.

    The alternatives are worse here. fp16 autocast needs a loss scaler, and a
    GradScaler assumes one process runs forward, backward and step: in this pipeline
    the loss lives on the last stage's peer while each stage backpropagates and steps
    on its own, so an overflow seen by one stage cannot skip the step of the others.
    Apple MPS: torch can autocast there (fp16, and bf16 on recent macOS), but fp16
    has the same scaler problem and bf16 depends on the OS version; fp32 is the
    setting that trains the same on every Mac."""
    native_bf16 = facts.capability is not None and facts.capability >= BF16_MIN_CAPABILITY
    if facts.device.startswith("cuda") and native_bf16:
        return torch.bfloat16
    return None


def precision_line(facts: DeviceFacts, dtype: torch.dtype | None) -> str:
    if dtype is not None:
        how = f"{_dtype_name(dtype)} autocast"
    elif facts.device.startswith("cuda"):
        major, minor = BF16_MIN_CAPABILITY
        how = f"fp32 (bf16 needs compute capability {major}.{minor} or newer)"
    elif facts.device == "mps":
        how = "fp32 (no autocast on MPS)"
    else:
        how = "fp32"
    return f"training on {facts.describe()} in {how}"


_announced: set[str] = set()


def training_precision(device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for ``device`` (None: fp32), logged once per device and process."""
    facts = device_facts(device)
    dtype = autocast_dtype(facts)
    if facts.device not in _announced:
        _announced.add(facts.device)
        log.info(precision_line(facts, dtype))
    return dtype


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


# -- out of memory -------------------------------------------------------------------

def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError is this class
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def explain_oom(exc: BaseException, *, model_size: str, stage: int, num_stages: int,
                device: torch.device | str, vocab_size: int, batch_size: int, seq_len: int,
                outer_state: bool = True,
                layers_per_stage: Sequence[int] | None = None) -> OutOfMemory | None:
    """The one-line OutOfMemory for ``exc`` when it is an out-of-memory failure of
    training stage ``stage``; None for any other exception (re-raise it)."""
    if not is_out_of_memory(exc):
        return None
    config = model_config(model_size, vocab_size=vocab_size, max_seq_len=seq_len)
    facts = device_facts_or_name(device)
    need = estimate_stage_memory(config, num_stages=num_stages, stage_index=stage, batch_size=batch_size,
                                 seq_len=seq_len, autocast_bf16=autocast_dtype(facts) is torch.bfloat16,
                                 outer_state=outer_state, layers_per_stage=layers_per_stage)
    what = (f"stage {stage} of {num_stages} of the {model_size} model ({need.parameters / 1e6:,.1f}M of "
            f"{config.num_parameters() / 1e6:,.1f}M parameters)")
    return out_of_memory(facts, what, need, batch_size=batch_size, seq_len=seq_len,
                         tries=["a smaller model", "more pipeline stages (num_stages in the run spec)",
                                "a smaller batch_size or seq_len in the run spec"])


def out_of_memory(facts: DeviceFacts, what: str, need: StageMemory, *, batch_size: int, seq_len: int,
                  tries: list[str]) -> OutOfMemory:
    """The one-line error; ``tries`` lists what to change, --device cpu is added off the CPU."""
    total = f"{format_bytes(facts.total_memory_bytes)} in all" if facts.total_memory_bytes else "size unknown"
    if facts.device != "cpu":
        tries = [*tries, "--device cpu"]
    return OutOfMemory(
        f"out of memory on {facts.device} ({facts.name}, {total}) training {what}: it needs about "
        f"{format_bytes(need.peak_bytes)} ({format_bytes(need.state_bytes)} weights and optimizer state, "
        f"{format_bytes(max(need.activation_bytes, need.outer_step_bytes))} working memory for "
        f"{batch_size} x {seq_len}-token micro-batches); try {', '.join(tries[:-1])} or {tries[-1]}")


def device_facts_or_name(device: torch.device | str) -> DeviceFacts:
    """Device facts for a message; a device too broken to describe still gets named."""
    try:
        return device_facts(device)
    except Exception:  # we are already reporting a failure of this device
        return DeviceFacts(str(device), str(torch.device(device).type), None, None)


def explain_run_oom(exc: BaseException, spec: RunSpec, *, stage: int, vocab_size: int,
                    device: torch.device | str) -> OutOfMemory | None:
    """explain_oom for training ``stage`` of the run ``spec``."""
    return explain_oom(exc, model_size=spec.model_size, stage=stage, num_stages=spec.num_stages,
                       device=device,
                       vocab_size=vocab_size, batch_size=spec.batch_size, seq_len=spec.seq_len,
                       outer_state=spec.method.has_outer_step, layers_per_stage=spec.layers_per_stage)


@contextlib.contextmanager
def oom_explained(spec: RunSpec, *, stage: int, vocab_size: int,
                  device: torch.device | str) -> Iterator[None]:
    """Turn an out-of-memory failure inside the block into OutOfMemory (see
    explain_run_oom); every other exception passes unchanged. Works around an
    ``await`` too."""
    try:
        yield
    except Exception as exc:
        error = explain_run_oom(exc, spec, stage=stage, vocab_size=vocab_size, device=device)
        if error is None:
            raise
        raise error from exc
