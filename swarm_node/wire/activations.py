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


def encode_activations(t: torch.Tensor, codec: str) -> list[torch.Tensor]:
    """Activations, or their gradient, as the run's activation codec sends them."""
    if codec == "int8":
        q = quantize(t, 8)
        return [q.codes, q.scales]
    return [t.to(WIRE_PRECISIONS[codec])]


def decode_activations(tensors: list[torch.Tensor], shape: tuple[int, ...], codec: str) -> torch.Tensor:
    """The fp32 tensor of ``shape`` that ``encode_activations`` sent, or ProtocolError;
    blockwise codes are checked against the shape before anything is allocated."""
    if codec == "int8":
        if len(tensors) != 2:
            raise ProtocolError("int8 activations come as codes and steps")
        return dequantize(Quantized(tensors[0], tensors[1], tuple(shape), 8), max_numel=math.prod(shape))
    if len(tensors) != 1:
        raise ProtocolError(f"expected one tensor of {tuple(shape)} floats")
    return checked_floats(tensors[0], shape).float()
