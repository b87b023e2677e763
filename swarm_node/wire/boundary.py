"""A coded stage boundary on the wire (docs/ALGORITHM.md section 9, model/boundary.py):
what a forward request and its answer carry when the run's activation codec is a
bottleneck or a subspace, and how many values a token the run's compression ratio
leaves room for.

    forward request: header {kind, spec, deadline_s, batch, seq}
                     codes (u8), steps (f32): the (batch, seq, width) code, blockwise (wire/blockwise.py)
                     ids (u8): the window's seq + 1 token ids, bit-packed at ceil(log2 vocab) bits each
                     (inputs are ids[:, :-1], targets ids[:, 1:]: a stage rebuilds the stream from them)
    answer:          header {ok, loss}; codes, steps: the gradient with respect to the code

Everything counts against the ratio: the values, their steps, the ids and the frame
with its header. A ratio r at hidden size d allows 2 d / r bytes a token (fp16 sends 2 d)
in each direction; the forward request, which also carries the ids, is the larger.

A decoder never trusts the sender: shapes come from the run (width) and from the
header's batch and seq (checked against the stage's caps before anything is
allocated), codes and steps are checked by the blockwise decoder, the ids against the
vocabulary, and values must be finite and below MAX_MAGNITUDE. Anything else is a
ProtocolError, which the caller counts against the sender."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm_node.errors import ConfigError, ProtocolError
from swarm_node.wire.blockwise import BLOCK, Quantized, dequantize, quantize
from swarm_node.wire.frames import encode_frame

# activation_codec name -> (model/boundary.py kind, bits a value on the wire): at equal
# bytes, 4 bits buy twice the width of 8 (docs/ALGORITHM.md section 9 compares them).
BOUNDARY_CODECS: dict[str, tuple[str, int]] = {
    "bottleneck4": ("bottleneck", 4), "bottleneck8": ("bottleneck", 8),
    "subspace4": ("subspace", 4), "subspace8": ("subspace", 8),
}
# Decoded values above this are refused: every sum over a tensor of them stays finite in
# float32 (2**60 x 2**31 elements < 2**128), so the finiteness checks downstream are exact.
MAX_MAGNITUDE = 2.0 ** 60
MAX_DEADLINE_S = 3600
_WORST_HEADER = {"kind": "fwd", "spec": "0" * 16, "deadline_s": float(MAX_DEADLINE_S)}


def id_bits(vocab_size: int) -> int:
    """Bits a token id takes on the wire."""
    return max(1, math.ceil(math.log2(vocab_size)))


@dataclass(frozen=True)
class BoundaryCodec:
    """A run's coded boundary: ``width`` values a token of ``bits`` bits each way, and
    the token ids of the window at ``id_bits`` bits."""

    kind: str
    bits: int
    width: int
    vocab_size: int

    @property
    def id_bits(self) -> int:
        return id_bits(self.vocab_size)

    def request_bytes(self, batch: int, seq: int) -> int:
        """Bytes of a forward request for a micro-batch of ``batch`` x ``seq`` tokens."""
        return len(forward_request(_WORST_HEADER, torch.zeros(batch, seq, self.width),
                                   torch.zeros(batch, seq + 1, dtype=torch.long), self))

    def answer_bytes(self, batch: int, seq: int) -> int:
        return len(gradient_answer({"ok": True, "loss": 1.0}, torch.zeros(batch, seq, self.width), self))


def boundary_codec(name: str, *, hidden_size: int, ratio: float, vocab_size: int, batch: int,
                   seq: int) -> BoundaryCodec:
    """The widest code whose forward request and answer take at most 2 hidden_size /
    ratio bytes a token for micro-batches of ``batch`` x ``seq`` tokens; ConfigError if
    not even one value a token fits."""
    if name not in BOUNDARY_CODECS:
        raise ConfigError(f"unknown boundary codec {name!r}; choose one of {', '.join(BOUNDARY_CODECS)}")
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 1):
        raise ConfigError(f"activation_ratio must be a number above 1, got {ratio!r}")
    kind, bits = BOUNDARY_CODECS[name]
    budget = 2 * hidden_size / ratio * batch * seq  # bytes a micro-batch
    per_value = bits / 8 + 4 / BLOCK
    ids = id_bits(vocab_size) * batch * (seq + 1) / 8
    width = max(1, math.floor((budget - ids) / (per_value * batch * seq)))
    while width >= 1:
        codec = BoundaryCodec(kind, bits, width, vocab_size)
        if max(codec.request_bytes(batch, seq), codec.answer_bytes(batch, seq)) <= budget:
            return codec
        width -= 1
    raise ConfigError(
        f"activation_ratio {ratio:g} leaves {budget / batch / seq:.2f} bytes a token at hidden size "
        f"{hidden_size}: too few for the token ids ({id_bits(vocab_size)} bits) and one value; "
        "choose a lower ratio"
    )


# -- token ids ----------------------------------------------------------------------------
def pack_ids(ids: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative ids below 2**bits as a uint8 bit stream, ``bits`` bits each, lowest
    bit first."""
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >> bits):
        raise ValueError(f"ids must lie in [0, 2**{bits})")
    stream = ((flat[:, None] >> torch.arange(bits)) & 1).to(torch.uint8).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def packed_id_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def unpack_ids(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``count`` ids (int64) from :func:`pack_ids`' stream; the caller checks the length."""
    stream = ((packed[:, None].to(torch.int64) >> torch.arange(8)) & 1).reshape(-1)[:count * bits]
    return (stream.view(count, bits) << torch.arange(bits)).sum(dim=1)


# -- frames -------------------------------------------------------------------------------
def encode_code(values: torch.Tensor, codec: BoundaryCodec) -> list[torch.Tensor]:
    """A (batch, seq, width) code, or its gradient: blockwise codes and their steps."""
    q = quantize(values, codec.bits)
    return [q.codes, q.scales]


def decode_code(tensors: list[torch.Tensor], shape: tuple[int, int, int],
                codec: BoundaryCodec) -> torch.Tensor:
    """The float32 (batch, seq, width) tensor :func:`encode_code` sent, or ProtocolError."""
    if len(tensors) != 2:
        raise ProtocolError("a coded boundary sends codes and their steps")
    if shape[-1] != codec.width:
        raise ProtocolError(f"a code of width {shape[-1]} where the run's is {codec.width}")
    coded = Quantized(tensors[0], tensors[1], tuple(shape), codec.bits)
    values = dequantize(coded, max_numel=math.prod(shape))
    if values.numel() and not bool(values.abs().amax() <= MAX_MAGNITUDE):  # NaN fails too
        raise ProtocolError("code values are not finite or out of range")
    return values


def forward_request(header: dict, code: torch.Tensor, ids: torch.Tensor, codec: BoundaryCodec) -> bytes:
    """The forward request for a (batch, seq, width) ``code`` and the window's (batch,
    seq + 1) token ids."""
    batch, seq, _ = code.shape
    if tuple(ids.shape) != (batch, seq + 1):
        raise ValueError(f"ids of shape {tuple(ids.shape)} for a code of {tuple(code.shape)}")
    return forward_frame(header, encode_code(code, codec), ids, codec)


def forward_frame(header: dict, coded: list[torch.Tensor], ids: torch.Tensor, codec: BoundaryCodec) -> bytes:
    """The forward request for a code already encoded (:func:`encode_code`, as a node
    does it on its compute thread) and the window's (batch, seq + 1) token ids."""
    batch, seq = ids.shape[0], ids.shape[1] - 1
    return encode_frame({**header, "batch": batch, "seq": seq}, [*coded, pack_ids(ids, codec.id_bits)])


def window_ids(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The (batch, seq + 1) window a micro-batch's inputs and targets were cut from."""
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def check_forward_request(header: dict, tensors: list[torch.Tensor], codec: BoundaryCodec, *, spec_hash: str,
                          max_batch: int, max_seq: int,
                          default_deadline_s: float) -> tuple[float, torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """``/swarm-node/forward`` with a coded boundary: (deadline in s, the code as fp32,
    input ids, target ids), both id tensors (batch, seq) int64; else ProtocolError."""
    if header.get("kind") != "fwd" or header.get("spec") != spec_hash:
        raise ProtocolError("not a forward request of this run")
    deadline = header.get("deadline_s", default_deadline_s)
    if type(deadline) not in (int, float) or not 0 < deadline <= MAX_DEADLINE_S:
        raise ProtocolError(f"bad deadline {deadline!r}")
    batch, seq = header.get("batch"), header.get("seq")
    if type(batch) is not int or type(seq) is not int or not 0 < batch <= max_batch or not 0 < seq <= max_seq:
        raise ProtocolError(f"a micro-batch of {batch!r} x {seq!r} tokens does not fit this stage")
    if len(tensors) != 3:
        raise ProtocolError("a coded forward request holds codes, steps and token ids")
    packed = tensors[2]
    count = batch * (seq + 1)
    expected = packed_id_bytes(count, codec.id_bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise ProtocolError(f"token ids do not fit {count} ids of {codec.id_bits} bits")
    ids = unpack_ids(packed, codec.id_bits, count)
    if int(ids.max()) >= codec.vocab_size:
        raise ProtocolError("token ids out of the vocabulary")
    try:
        code = decode_code(tensors[:2], (batch, seq, codec.width), codec)
    except ProtocolError as exc:
        raise ProtocolError(f"code does not fit this stage: {exc}") from None
    ids = ids.view(batch, seq + 1)
    return float(deadline), code, ids[:, :-1], ids[:, 1:]


def gradient_answer(header: dict, grad: torch.Tensor, codec: BoundaryCodec) -> bytes:
    return encode_frame(header, encode_code(grad, codec))


def check_gradient(tensors: list[torch.Tensor], shape: tuple[int, int, int],
                   codec: BoundaryCodec) -> torch.Tensor:
    """The gradient in an answer to our forward request of a ``shape`` code, or ProtocolError."""
    try:
        return decode_code(tensors, shape, codec)
    except ProtocolError:
        raise ProtocolError("gradient does not match the code sent") from None


def bytes_per_token(codec: BoundaryCodec, batch: int, seq: int) -> tuple[float, float]:
    """(forward request, answer) bytes a token, everything in the frames counted."""
    tokens = batch * seq
    return codec.request_bytes(batch, seq) / tokens, codec.answer_bytes(batch, seq) / tokens


__all__ = ["BOUNDARY_CODECS", "BoundaryCodec", "boundary_codec", "bytes_per_token", "check_forward_request",
           "check_gradient", "decode_code", "encode_code", "forward_frame", "forward_request",
           "gradient_answer", "pack_ids", "unpack_ids", "window_ids"]
