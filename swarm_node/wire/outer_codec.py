"""What an outer round sends: phi and Delta, one tensor of each per parameter, in a
float precision or blockwise (wire/blockwise.py). The run spec names the codec, so every
peer of a run sends and expects the same.

phi is a level, close to the receiver's own phi (partners pull towards each other every
round), so the ``near`` codecs code it against what the receiver holds: only the low
bits of its grid index travel, on a grid as fine as the distance between partners
allows (measured on the partners of earlier rounds, ``observe``). Before a node has had
a partner it expects one as far as its own Delta reaches in each block: peers start
from the same weights, or from a donor's phi, and move apart by about a round's Delta.

Blockwise payloads carry error feedback: what a round could not send is added to what
the next round sends, once the round is done. For Delta (an increment) progress is
delayed, never dropped. For phi (sent to a different partner each round) it keeps the
sender's rounding from adding up: what the swarm received of our phi drifts from it by
at most one round's error.

Every member of a group, the sender included, uses the *decoded* values for the group
means, so partners agree on them bit for bit (for ``near`` codecs: while partners are
within the grid's reach, which the steps leave twice the distance seen for)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm_node.errors import ProtocolError
from swarm_node.wire.blockwise import BLOCK, ErrorFeedback, Quantized, block_gap, dequantize, dequantize_near
from swarm_node.wire.frames import WIRE_PRECISIONS, checked_floats, finite

Tensors = list[torch.Tensor]
# The distance a node expects to its next partner, per block: the largest it saw to its
# partners of the last GAP_ROUNDS rounds, and never less than its own Delta reaches. It was
# the last partner's, or 0.7 of what it expected: a joiner and its donor start on the same
# phi, so each round they paired shrank both grids by 0.7, until a partner further away
# than the grid reached decoded to within a few steps of its own phi (whatever the sender's
# phi, the nearest index with its residue is near the receiver's): it saw that partner as
# close, was not pulled to it, and shrank its own grid in turn. Stages with joiners drifted
# apart (stage-1 replicas 13-35 apart against a round's motion of 0.3-1.6 in the honest-join
# runs, where stage 0 stayed at 1-4), and honest donors fell outside the state check.
GAP_ROUNDS = 8


@dataclass(frozen=True)
class OuterCodec:
    name: str
    phi_bits: int | None = None  # None: the float precision below
    delta_bits: int | None = None
    precision: str = "fp16"  # for tensors not sent blockwise
    phi_near: bool = False  # phi coded against the receiver's own

    def bytes_per_parameter(self) -> float:
        """Both tensors, steps included (fp16 tensors out of range go as fp32: not counted)."""
        return self._part_bytes(self.phi_bits) + self._part_bytes(self.delta_bits)

    def delta_share(self) -> float:
        """Delta's part of the bytes a round sends: how far into the exchange a Delta
        sent ahead of phi is in."""
        return self._part_bytes(self.delta_bits) / self.bytes_per_parameter()

    def _part_bytes(self, bits: int | None) -> float:
        if bits is None:
            return WIRE_PRECISIONS[self.precision].itemsize
        return bits / 8 + 4 / BLOCK


OUTER_CODECS = {c.name: c for c in (
    OuterCodec("fp32", precision="fp32"),
    OuterCodec("fp16"),
    OuterCodec("bf16", precision="bf16"),
    OuterCodec("int8", 8, 8),
    OuterCodec("int4", 4, 4),
    OuterCodec("near4-4", 4, 4, phi_near=True),  # phi in 4 bits against the receiver's, Delta in 4
    OuterCodec("near4-3", 4, 3, phi_near=True),  # Delta in 3: 0.91 bytes a parameter
)}


def outer_codec(name: str) -> OuterCodec:
    try:
        return OUTER_CODECS[name]
    except KeyError:
        raise ValueError(f"unknown outer codec {name!r}; choose one of {', '.join(OUTER_CODECS)}") from None


class OuterEncoder:
    """One per worker: encodes its (phi, Delta) each round, with error feedback for the
    blockwise ones (``commit`` once the round is done)."""

    def __init__(self, codec: OuterCodec):
        self.codec = codec
        self.feedback = {kind: ErrorFeedback(bits) if bits else None
                         for kind, bits in (("phi", codec.phi_bits), ("delta", codec.delta_bits))}
        self.seen: deque[Tensors] = deque(maxlen=GAP_ROUNDS)  # near codecs: distances to recent partners

    def encode(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]) -> Tensors:
        """What goes on the wire: phi's tensors, then Delta's."""
        wire: Tensors = []
        for kind, tensors in (("phi", phi), ("delta", delta)):
            feedback = self.feedback[kind]
            if feedback is None:
                dtype = WIRE_PRECISIONS[self.codec.precision]
                wire += [_to_float_wire(t, dtype) for t in tensors]
                continue
            if kind == "phi" and self.codec.phi_near:
                coded = feedback.compress(tensors, gaps=self.expected_gaps(delta))
            else:
                coded = feedback.compress(tensors)
            wire += [part for q in coded for part in (q.codes, q.scales)]
        return wire

    def commit(self) -> None:
        for feedback in self.feedback.values():
            if feedback is not None:
                feedback.commit()

    def observe(self, own_phi: Sequence[torch.Tensor],
                partners_phi: Sequence[Sequence[torch.Tensor]]) -> None:
        """The distance to this round's partners, as decoded and checked: the grid of our
        next payloads leaves room for twice the distance we expect (``expected_gaps``)."""
        if not self.codec.phi_near or not partners_phi:
            return
        self.seen.append([torch.stack([block_gap(p[k], own) for p in partners_phi]).amax(dim=0)
                          for k, own in enumerate(own_phi)])

    def expected_gaps(self, delta: Sequence[torch.Tensor]) -> Tensors:
        """Per phi tensor and block, how far our next partner may be: the largest distance
        to the partners of the last GAP_ROUNDS rounds, at least as far as our Delta reaches
        (before any partner, peers start from the same weights or a donor's phi and drift
        apart by about a round's Delta)."""
        gaps = [block_gap(d, torch.zeros_like(d)) for d in delta]
        for seen in self.seen:
            gaps = [torch.maximum(g, s.to(g.device)) for g, s in zip(gaps, seen)]
        return gaps


def decode_outer(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size], codec: OuterCodec,
                 device: torch.device, near: Sequence[torch.Tensor] = ()) -> tuple[Tensors, Tensors]:
    """A partner's (phi, Delta) from a frame's tensors, checked against our own shapes;
    ``near``: our own phi, for near codecs. ProtocolError for anything that does not fit
    (nothing is allocated before the sizes are checked: the blockwise decoders check
    codes and steps first)."""
    phi_count = part_tensors(codec, "phi", len(shapes))
    delta_count = part_tensors(codec, "delta", len(shapes))
    if len(tensors) != phi_count + delta_count:
        raise ProtocolError(f"outer payload has {len(tensors)} tensors; the {codec.name} codec sends "
                            f"{phi_count + delta_count} for this stage")
    return (decode_outer_part(tensors[:phi_count], shapes, codec, device, "phi", near),
            decode_outer_part(tensors[phi_count:], shapes, codec, device, "delta"))


def part_tensors(codec: OuterCodec, part: str, parameters: int) -> int:
    """How many wire tensors carry ``part`` ("phi" or "delta") of a stage of
    ``parameters`` tensors: one each as floats, codes and steps each when blockwise."""
    bits = codec.phi_bits if part == "phi" else codec.delta_bits
    return parameters * (1 if bits is None else 2)


def decode_outer_part(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size], codec: OuterCodec,
                      device: torch.device, part: str, near: Sequence[torch.Tensor] = ()) -> Tensors:
    """One part of a partner's payload, phi or Delta, sent on its own (a Delta ahead of
    its phi, ALGORITHM.md 3.1), checked as :func:`decode_outer` checks it."""
    count = part_tensors(codec, part, len(shapes))
    if len(tensors) != count:
        raise ProtocolError(f"outer {part} has {len(tensors)} tensors; the {codec.name} codec sends {count} "
                            f"for this stage")
    if part == "phi":
        return _decode_one(tensors, shapes, codec.phi_bits, device, near if codec.phi_near else None)
    return _decode_one(tensors, shapes, codec.delta_bits, device)


def _decode_one(tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size], bits: int | None,
                device: torch.device, near: Sequence[torch.Tensor] | None = None) -> Tensors:
    if bits is None:
        return [checked_floats(t, shape).to(device) for t, shape in zip(tensors, shapes)]
    coded = [Quantized(codes, scales, tuple(shape), bits)
             for codes, scales, shape in zip(tensors[0::2], tensors[1::2], shapes)]
    if near is not None:
        return [dequantize_near(q, own).to(device) for q, own in zip(coded, near)]
    return [dequantize(q, max_numel=shape.numel()).to(device) for q, shape in zip(coded, shapes)]


def _to_float_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = t.detach().to(dtype)
    if dtype == torch.float16 and not finite(out):
        return t.detach().float()  # out of fp16 range: send this tensor in full precision
    return out
