"""Blockwise quantisation of tensors for the wire: 8, 4, 3 or 2 bits a value plus one
float32 step per block of BLOCK values. 8 bits cost 1.016 bytes a value, 4 bits 0.516,
3 bits 0.391 and 2 bits 0.266, against 2 for fp16. An outlier only coarsens its own
block.

Two ways to code a block:

- ``quantize``: on its own. The step is the block's largest magnitude over the largest
  code, and codes run from -levels to +levels.
- ``quantize_log``: for a tensor of non-negative values spanning orders of magnitude
  (Adam's exp_avg_sq): 8-bit codes on a log2 grid of LOG_STEPS_PER_OCTAVE steps an
  octave below the block's largest value, which is the block's scale; code 0 is zero.
  Every value keeps the same relative precision (rounded up, by 4.4 % at most, 2.2 %
  on its square root), where a linear grid loses small values to the block's largest.
- ``quantize_near``: for a receiver that holds a tensor close to this one (partners'
  phi). The step comes from how far apart the two are expected to be, and only the
  lowest ``bits`` bits of the grid index are sent; the receiver takes the index of that
  residue nearest to its own tensor. Exact to half a step while the two are less than
  2^(bits-1) steps apart; whatever is sent, a decoded value lies within 2^(bits-1)
  steps of the receiver's own, so a liar can pull it only as far as the steps it
  declares (which the partner check bounds).

Decoding checks everything before allocating, like the frame codec: the codes' dtype
and length against the shape, the steps' count, dtype and values (finite, at most
MAX_STEP; positive for ``quantize_near``). An increment that is sent again and again
(Delta) keeps what a round could not send and adds it to the next (ErrorFeedback): the
error does not accumulate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm_node.errors import ProtocolError

BLOCK = 256
BITS = (8, 4, 3, 2)
MIN_NEAR_STEP = 1e-12  # blocks where partners agree exactly still get a usable grid
# The largest step a peer may send: 2^8 of them (a code's reach either way) stay within
# half of float32's range, so no decoded value is infinite (steps near float32's largest
# make every code past 1 infinite); no honest block comes near it.
MAX_STEP = torch.finfo(torch.float32).max / 2 ** 9


def _levels(bits: int) -> int:
    """The largest code magnitude of ``quantize``: codes run from -levels to +levels."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return 2 ** (bits - 1) - 1


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of one packed group: 8 codes in 3 bytes for 3 bits."""
    per_group = 8 // math.gcd(bits, 8)
    return per_group, per_group * bits // 8


def packed_bytes(numel: int, bits: int) -> int:
    per_group, group_bytes = _group(bits)
    return -(-numel // per_group) * group_bytes


@dataclass(frozen=True)
class Quantized:
    codes: torch.Tensor  # uint8, packed: groups of codes, the first in the low bits
    scales: torch.Tensor  # float32, one step a block
    shape: tuple[int, ...]
    bits: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()


def _blocks(tensor: torch.Tensor, block: int) -> torch.Tensor:
    flat = tensor.detach().float().flatten()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)


def quantize(tensor: torch.Tensor, bits: int = 8, block: int = BLOCK) -> Quantized:
    levels = _levels(bits)
    numel = tensor.numel()
    padded = _blocks(tensor, block)
    scales = padded.abs().amax(dim=1) / levels
    if not torch.isfinite(scales).all():
        raise ValueError("cannot quantize non-finite values")
    codes = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    codes = (codes.clamp(-levels, levels) + levels).to(torch.uint8).flatten()[:numel]
    return Quantized(_pack(codes, bits), scales, tuple(tensor.shape), bits)


# 255 codes reach 2^-15.9 of a block's largest value (the exp_avg_sq of a trained stage spanned
# 8 octaves within a block at most)
LOG_STEPS_PER_OCTAVE = 16


def quantize_log(tensor: torch.Tensor, block: int = BLOCK) -> Quantized:
    """8-bit codes of non-negative values on a log grid below each block's largest value
    (the block's scale): code c > 0 stands for scale * 2^((c - 255) / LOG_STEPS_PER_OCTAVE)
    and code 0 for zero. A value is coded as the grid point at or above it (and one below
    the grid's reach as its lowest point): never below, where a smaller exp_avg_sq would
    make an Adam step larger and could put exp_avg past the bound an Adam keeps
    (InnerOptimizer.moments_problem)."""
    numel = tensor.numel()
    padded = _blocks(tensor, block)
    if not torch.isfinite(padded).all() or (padded < 0).any():
        raise ValueError("quantize_log takes finite values that are not negative")
    scales = padded.amax(dim=1)
    top = 2 ** 8 - 1
    nonzero = padded > 0
    octaves = torch.log2(scales[:, None].double() / torch.where(nonzero, padded, 1).double())
    codes = (top - torch.floor(octaves * LOG_STEPS_PER_OCTAVE)).clamp(1, top)
    codes = torch.where(nonzero, codes, 0).to(torch.uint8).flatten()[:numel]
    return Quantized(codes, scales, tuple(tensor.shape), 8)


def dequantize_log(q: Quantized, block: int = BLOCK, max_numel: int = 1 << 31) -> torch.Tensor:
    """The float32 tensor ``quantize_log`` coded, or ProtocolError for anything
    inconsistent (every 8-bit code is one of the grid's)."""
    if q.bits != 8:
        raise ProtocolError(f"log codes are 8 bits, not {q.bits!r}")
    numel = _checked(q, block, max_numel, positive=False)
    codes = torch.nn.functional.pad(q.codes.double(), (0, -numel % block)).view(-1, block)
    values = q.scales.double()[:, None] * torch.exp2((codes - (2 ** 8 - 1)) / LOG_STEPS_PER_OCTAVE)
    return torch.where(codes > 0, values, 0).flatten()[:numel].float().view(q.shape)


def quantize_near(tensor: torch.Tensor, bits: int, gap: torch.Tensor, block: int = BLOCK) -> Quantized:
    """Codes for a receiver whose tensor is expected within ``gap`` (one value a block)
    of this one: steps of twice the gap over 2^(bits-1) - 1, so a receiver twice as far
    still decodes to within half a step (its index, off by up to 2^(bits-1) - 1 steps
    and half a step of rounding, stays closer to ours than to the next residue)."""
    levels = _levels(bits)
    numel = tensor.numel()
    steps = (2 * gap.to(tensor.device, torch.float32) / levels).clamp_min(MIN_NEAR_STEP)
    if not torch.isfinite(steps).all():
        raise ValueError("cannot quantize with a non-finite gap")
    index = torch.round(_blocks(tensor, block).double() / steps.double()[:, None])
    codes = torch.remainder(index, 2 ** bits).to(torch.uint8).flatten()[:numel]
    return Quantized(_pack(codes, bits), steps, tuple(tensor.shape), bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_group, group_bytes = _group(bits)
    if per_group == 1:
        return codes
    lanes = torch.nn.functional.pad(codes, (0, -codes.numel() % per_group)).view(-1,
                                                                                 per_group).to(torch.int32)
    word = torch.zeros(lanes.shape[0], dtype=torch.int32, device=codes.device)
    for lane in range(per_group):
        word |= lanes[:, lane] << (bits * lane)
    return torch.stack([(word >> (8 * b)) & 0xFF for b in range(group_bytes)],
                       dim=1).to(torch.uint8).flatten()


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per_group, group_bytes = _group(bits)
    if per_group == 1:
        return packed
    groups = packed.view(-1, group_bytes).to(torch.int32)
    word = torch.zeros(groups.shape[0], dtype=torch.int32, device=packed.device)
    for b in range(group_bytes):
        word |= groups[:, b] << (8 * b)
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * lane)) & mask for lane in range(per_group)], dim=1).flatten()[:numel]


def _checked(q: Quantized, block: int, max_numel: int, positive: bool) -> int:
    """The element count ``q`` stands for, or ProtocolError for anything inconsistent."""
    if q.bits not in BITS:
        raise ProtocolError(f"unknown code width {q.bits!r}")
    if not all(type(d) is int and d >= 0 for d in q.shape):
        raise ProtocolError(f"bad shape {q.shape!r}")
    numel = math.prod(q.shape)
    if numel > max_numel:
        raise ProtocolError(f"{numel} values exceed the cap of {max_numel}")
    if q.codes.dtype != torch.uint8 or q.codes.dim() != 1 or q.codes.numel() != packed_bytes(numel, q.bits):
        raise ProtocolError(f"codes do not fit {numel} values of {q.bits} bits")
    if q.scales.dtype != torch.float32 or q.scales.dim() != 1 or q.scales.numel() != -(-numel // block):
        raise ProtocolError(f"expected {-(-numel // block)} float32 scales")
    if (not torch.isfinite(q.scales).all() or (q.scales <= 0 if positive else q.scales < 0).any()
            or (q.scales > MAX_STEP).any()):
        raise ProtocolError(f"steps out of range: each must be finite, at most {MAX_STEP:.1e} and "
                            + ("positive" if positive else "not negative"))
    return numel


def dequantize(q: Quantized, block: int = BLOCK, max_numel: int = 1 << 31) -> torch.Tensor:
    """The float32 tensor ``q`` stands for, or ProtocolError for anything inconsistent."""
    numel = _checked(q, block, max_numel, positive=False)
    levels = _levels(q.bits)
    values = _unpack(q.codes, q.bits, numel).float() - levels
    if (values.abs() > levels).any():
        raise ProtocolError(f"a code outside -{levels}..{levels}")
    values = torch.nn.functional.pad(values, (0, -numel % block)).view(-1, block) * q.scales[:, None]
    return values.flatten()[:numel].view(q.shape)


def dequantize_near(q: Quantized, near: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """What ``quantize_near`` coded, read against our own ``near`` (of q's shape)."""
    numel = _checked(q, block, near.numel(), positive=True)
    if tuple(near.shape) != q.shape:
        raise ProtocolError(f"shape {q.shape} does not fit ours {tuple(near.shape)}")
    steps = q.scales.to(near.device).double()[:, None]
    codes = _unpack(q.codes.to(near.device), q.bits, numel).double()
    codes = torch.nn.functional.pad(codes, (0, -numel % block)).view(-1, block)
    ours = _blocks(near, block).double() / steps
    modulus = 2 ** q.bits
    index = codes + modulus * torch.round((ours - codes) / modulus)
    return (index * steps).flatten()[:numel].float().view(q.shape)


def block_gap(theirs: torch.Tensor, ours: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The largest distance between two tensors in each block."""
    return (_blocks(theirs, block) - _blocks(ours.to(theirs.device), block)).abs().amax(dim=1)


class ErrorFeedback:
    """What earlier rounds could not send, added to the next round's tensors. The
    remainder of a round counts once the round is done (``commit``): a round given up
    leaves it as it was."""

    def __init__(self, bits: int, block: int = BLOCK):
        self.bits, self.block = bits, block
        self.residual: list[torch.Tensor] | None = None
        self._pending: list[torch.Tensor] | None = None

    def compress(self, tensors: Sequence[torch.Tensor],
                 gaps: Sequence[torch.Tensor] | None = None) -> list[Quantized]:
        """Coded on their own, or (``gaps``) for a receiver holding tensors that close."""
        wanted = [t.float() + r for t, r in zip(tensors, self.residual)] if self.residual else \
            [t.float() for t in tensors]
        if gaps is None:
            sent = [quantize(t, self.bits, self.block) for t in wanted]
            self._pending = [w - dequantize(q, self.block).to(w.device) for w, q in zip(wanted, sent)]
        else:
            sent = [quantize_near(t, self.bits, g, self.block) for t, g in zip(wanted, gaps)]
            self._pending = [w - dequantize_near(q, w, self.block) for w, q in zip(wanted, sent)]
        return sent

    def commit(self) -> None:
        if self._pending is not None:
            self.residual, self._pending = self._pending, None
