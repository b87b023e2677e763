"""A stage's state as a joiner downloads it (``/swarm-node/state/3.0.0``, docs/PROTOCOL.md
4.4): 7.1 bytes a parameter where fp32 took 20, decoded chunk by chunk as it arrives.

- phi in fp16 and the fp16 rounding's remainder in 8-bit blocks (wire/blockwise.py): 3.02
  bytes, within about 1e-6 of phi relative to its block's largest value. The state check
  (state/check.py) compares phi with the witnesses' own full-precision phi, and where the
  stage has not moved yet (every replica on the initial weights, no spread, no motion) its
  only slack is 1e-5 of |phi|: fp16 alone (2e-4) would refuse an honest donor there.
- theta as theta - phi (the progress in the round, small beside theta) in 8-bit blocks.
- the outer momentum in 8-bit blocks.
- exp_avg_sq (v) on an 8-bit log grid (blockwise.quantize_log): v spans orders of
  magnitude within a block, and every value keeps its relative precision (rounded up by
  4.4 % at most, 2.2 % on sqrt(v), what an Adam step divides by).
- exp_avg (m) as m / sqrt(v) in 8-bit blocks, against v as decoded: that ratio is the
  Adam step each element takes, so each element's step is as precise as the block's
  largest, however small its v (m itself on a linear grid lost the small ones).
- the step counts as they are (fp32, one a parameter).

Without an outer step (local-only replicas) theta is coded as phi is. The wire tensors go
section by section, each section parameter by parameter, so that what a tensor needs to
decode (phi for theta, v for m) has arrived before it. Decoding checks everything a
stranger could bend (counts, dtypes, shapes, lengths, finite and in-range steps) before
allocating and raises ProtocolError, never anything else."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from swarm_node.errors import ProtocolError
from swarm_node.wire.blockwise import (
    BLOCK,
    Quantized,
    dequantize,
    dequantize_log,
    packed_bytes,
    quantize,
    quantize_log,
)
from swarm_node.wire.frames import finite

Tensors = list[torch.Tensor]
# wire tensors per parameter in each section: (fp16 or fp32, codes, steps) or (codes, steps)
_LEVEL, _CODED = 3, 2


class TensorDigest:
    """sha256 over tensors in order (each its shape as a Python tuple's text, then its raw
    bytes), fed one tensor at a time: a joiner hashes chunks as they arrive."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, t: torch.Tensor) -> None:
        self._hash.update(str(tuple(t.shape)).encode())
        t = t.detach().contiguous().cpu()
        # numpy has no bf16
        self._hash.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def tensor_digest(tensors: Sequence[torch.Tensor]) -> str:
    digest = TensorDigest()
    for t in tensors:
        digest.update(t)
    return digest.hexdigest()


def _sections(slow: bool) -> list[tuple[str, int]]:
    """(name, wire tensors a parameter) in the order they travel, the step counts after."""
    weights = [("phi", _LEVEL), ("theta", _CODED), ("momentum", _CODED)] if slow else [("theta", _LEVEL)]
    return weights + [("exp_avg_sq", _CODED), ("exp_avg", _CODED)]


def wire_tensor_count(num_params: int, slow: bool) -> int:
    return num_params * sum(count for _, count in _sections(slow)) + 1


def wire_bytes_cap(shapes: Sequence[torch.Size], slow: bool) -> int:
    """The most an honest donor's wire tensors take for a stage of ``shapes`` (a level
    out of fp16's range goes as fp32)."""
    total = 4 * len(shapes)  # the step counts
    for shape in shapes:
        numel = shape.numel()
        coded = packed_bytes(numel, 8) + 4 * -(-numel // BLOCK)
        total += sum(4 * numel + coded if count == _LEVEL else coded for _, count in _sections(slow))
    return total


def _level(t: torch.Tensor) -> Tensors:
    """A level (phi; theta without an outer step): fp16 and the remainder in 8 bits."""
    high = t.detach().half()
    if not finite(high):
        high = t.detach().float()  # out of fp16's range: this tensor goes in fp32
    remainder = quantize(t.float() - high.float(), 8)
    return [high, remainder.codes, remainder.scales]


def _coded(t: torch.Tensor, log: bool = False) -> Tensors:
    q = quantize_log(t) if log else quantize(t, 8)
    return [q.codes, q.scales]


def _ratio(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """exp_avg over sqrt(exp_avg_sq) as decoded; 0 where that is 0 (no gradient yet)."""
    root = v.double().sqrt()
    return torch.where(root > 0, m.double() / root.clamp_min(1e-300), 0).float()


@torch.no_grad()
def encode_state(tensors: Sequence[torch.Tensor], num_params: int, slow: bool) -> Tensors:
    """The wire tensors of a snapshot laid out as StageWorker.snapshot lays it (theta,
    then phi and momentum with an outer step, then exp_avg, exp_avg_sq, step counts)."""
    n = num_params
    theta = tensors[:n]
    weights = (3 if slow else 1) * n
    exp_avg, exp_avg_sq = tensors[weights:weights + n], tensors[weights + n:weights + 2 * n]
    steps = tensors[-1]
    wire: Tensors = []
    if slow:
        phi = [_level(p) for p in tensors[n:2 * n]]
        wire += [part for coded in phi for part in coded]
        decoded_phi = [_decode_level(coded, t.shape) for coded, t in zip(phi, theta)]
        wire += [part for t, p in zip(theta, decoded_phi) for part in _coded(t.float() - p)]
        wire += [part for m in tensors[2 * n:3 * n] for part in _coded(m.float())]
    else:
        wire += [part for t in theta for part in _level(t)]
    coded_v = [_coded(v.float(), log=True) for v in exp_avg_sq]
    wire += [part for coded in coded_v for part in coded]
    for m, coded, t in zip(exp_avg, coded_v, theta):
        wire += _coded(_ratio(m, dequantize_log(Quantized(*coded, tuple(t.shape), 8))))
    return wire + [steps.float()]


def encoded_snapshot(snapshot: dict, num_params: int, slow: bool) -> dict:
    """StageWorker.snapshot's dict with its tensors as they travel, and their digest."""
    wire = encode_state(snapshot["tensors"], num_params, slow)
    return {**snapshot, "tensors": wire, "digest": tensor_digest(wire)}


def _decode_level(parts: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    high, codes, scales = parts
    if tuple(high.shape) != tuple(shape) or high.dtype not in (torch.float16, torch.float32):
        raise ProtocolError(f"a level of shape {tuple(high.shape)} / {high.dtype} where {tuple(shape)} "
                            "fp16 belong")
    if not finite(high):
        raise ProtocolError("a level with non-finite values")
    return high.float() + dequantize(Quantized(codes, scales, tuple(shape), 8), max_numel=shape.numel())


class StateDecoder:
    """Decodes a stage's wire tensors as they arrive (``feed`` each chunk's), holding the
    decoded fp32 state and at most a parameter's worth of wire tensors; ``finish`` gives
    the state in StageWorker.snapshot's layout. ProtocolError for anything that does not
    fit the stage (a tensor too many, one of the wrong kind, a bent code)."""

    def __init__(self, shapes: Sequence[torch.Size], slow: bool):
        self.shapes = [torch.Size(s) for s in shapes]
        self.slow = slow
        self._plan = [(name, k, count) for name, count in _sections(slow) for k in range(len(self.shapes))]
        self._plan.append(("steps", 0, 1))
        self._next = 0
        self._pending: Tensors = []
        self.decoded: dict[str, Tensors] = {name: [] for name, _ in _sections(slow)}
        self.decoded["steps"] = []

    @property
    def expected(self) -> int:
        return wire_tensor_count(len(self.shapes), self.slow)

    def feed(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if self._next >= len(self._plan):
                raise ProtocolError(f"the donor sent more than the {self.expected} tensors of this "
                                    "stage's state")
            self._pending.append(t)
            name, k, count = self._plan[self._next]
            if len(self._pending) == count:
                self.decoded[name].append(self._decode(name, k, self._pending))
                self._pending = []
                self._next += 1

    def _decode(self, name: str, k: int, parts: Tensors) -> torch.Tensor:
        if name == "steps":
            steps = parts[0]
            if tuple(steps.shape) != (len(self.shapes),) or not steps.is_floating_point():
                raise ProtocolError(f"step counts of shape {tuple(steps.shape)} / {steps.dtype}")
            return steps.float()
        shape = self.shapes[k]
        if len(parts) == _LEVEL:
            return _decode_level(parts, shape)
        coded = Quantized(parts[0], parts[1], tuple(shape), 8)
        if name == "exp_avg_sq":
            return dequantize_log(coded, max_numel=shape.numel())
        values = dequantize(coded, max_numel=shape.numel())
        if name == "theta":
            return values + self.decoded["phi"][k]
        if name == "exp_avg":
            return values * self.decoded["exp_avg_sq"][k].sqrt()
        return values

    def finish(self) -> Tensors:
        """theta (phi, momentum), exp_avg, exp_avg_sq, step counts: StageWorker.snapshot's layout."""
        if self._next != len(self._plan):
            raise ProtocolError(f"the donor's state ended after {self._next} of {len(self._plan)} parts")
        weights = ["theta", "phi", "momentum"] if self.slow else ["theta"]
        return [t for name in [*weights, "exp_avg", "exp_avg_sq", "steps"] for t in self.decoded[name]]
