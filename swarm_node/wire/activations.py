"""The activation codec: how activations and their gradients cross a stage boundary, as
the run spec's ``activation_codec`` says (docs/PROTOCOL.md 4.2). Pure torch; what a
decoded tensor must pass besides its shape is checked where it is used
(wire/messages.py, train/screen.py)."""

from __future__ import annotations

import math

import torch

from swarm_node.errors import ProtocolError
from swarm_node.wire.blockwise import Quantized, dequantize, quantize
from swarm_node.wire.frames import WIRE_PRECISIONS, checked_floats

# How activations and their gradients cross a stage boundary (the run spec's
# activation_codec): a float precision, or int8 blockwise codes with a float32 step per
# 256 values (wire/blockwise.py; 1.02 bytes a value against 2 for fp16).
ACTIVATION_CODECS = ("fp32", "fp16", "bf16", "int8")

# fp16 goes with a power-of-two scale per tensor that puts its largest magnitude in
# [2**14, 2**15). Plain fp16 ends at 65504, and a stage-0 output of finite, ordinary
# weights can grow past it on a few tokens (the next stage's RMSNorm ignores its scale):
# infinite on the wire, it would be refused by every peer of the next stage. The
# gradient coming back shrinks as the activation grows, into fp16's subnormals (below
# 6.1e-5), the same way. A power of two is exact both ways, so the scale costs no precision, only 4
# bytes.
FP16_TOP_EXPONENT = 15
MAX_FP16_SHIFT = 126  # 2.0**126 and 2.0**-126 are normal float32s


def encode_activations(t: torch.Tensor, codec: str) -> list[torch.Tensor]:
    """Activations, or their gradient, as the run's activation codec sends them."""
    if codec == "int8":
        q = quantize(t, 8)
        return [q.codes, q.scales]
    if codec == "fp16":
        return _scaled_fp16(t)
    return [t.to(WIRE_PRECISIONS[codec])]


def _scaled_fp16(t: torch.Tensor) -> list[torch.Tensor]:
    """fp16 values times 2**shift, and the shift as one int32; on t's device, no sync."""
    if t.numel() == 0:
        return [t.to(torch.float16), torch.zeros(1, dtype=torch.int32, device=t.device)]
    _, exponent = torch.frexp(t.detach().abs().amax().float())  # amax = m * 2**exponent, 0.5 <= m < 1
    shift = (FP16_TOP_EXPONENT - exponent).clamp(-MAX_FP16_SHIFT, MAX_FP16_SHIFT).to(torch.int32).reshape(1)
    return [torch.ldexp(t.float(), shift).to(torch.float16), shift]


def decode_activations(tensors: list[torch.Tensor], shape: tuple[int, ...], codec: str) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that ``encode_activations`` sent, or ProtocolError;
    blockwise codes are checked against the shape before anything is allocated."""
    if codec == "int8":
        if len(tensors) != 2:
            raise ProtocolError("int8 activations come as codes and steps")
        return dequantize(Quantized(tensors[0], tensors[1], tuple(shape), 8), max_numel=math.prod(shape))
    if codec == "fp16":
        if len(tensors) != 2:
            raise ProtocolError("fp16 activations come as values and their power-of-two scale")
        values, shift = checked_floats(tensors[0], shape), tensors[1]
        if shift.dtype != torch.int32 or tuple(shift.shape) != (1,) or abs(int(shift)) > MAX_FP16_SHIFT:
            raise ProtocolError(f"fp16 scale must be one int32 within +-{MAX_FP16_SHIFT}")
        # in place: a frame's tensors are private copies (wire/frames.py), and float()
        # of f16 is a new one; one allocation, not two, per tensor received
        return values.float().mul_(2.0 ** -int(shift))
    if len(tensors) != 1:
        raise ProtocolError(f"expected one tensor of {tuple(shape)} floats")
    return checked_floats(tensors[0], shape).float()
