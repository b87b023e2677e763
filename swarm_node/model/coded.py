"""A run's coded stage boundary (docs/ALGORITHM.md section 9) from its settings: how many
values a token its ratio leaves room for (wire/boundary.py) and the model that sends
them (model/boundary.py). The simulator and the node both build their stages from
this, so a swarm trains the model the simulator measured."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from swarm_node.model.boundary import BoundaryConfig
from swarm_node.model.config import ModelConfig
from swarm_node.model.stages import stage_cuts
from swarm_node.wire.boundary import BOUNDARY_CODECS, BoundaryCodec, boundary_codec


def coded_model(model: ModelConfig, *, activation_codec: str, activation_ratio: float | None, batch_size: int,
                seq_len: int, num_stages: int,
                layers_per_stage: Sequence[int] | None = None) -> tuple[ModelConfig, BoundaryCodec | None]:
    """(the model config with its BoundaryConfig, the wire's codec) for a coded
    ``activation_codec``, sized for micro-batches of ``batch_size`` x ``seq_len`` tokens;
    ``model`` and None for any other codec, or for one stage (no boundary to cross)."""
    if activation_codec not in BOUNDARY_CODECS:
        return model, None
    cuts = stage_cuts(model.num_layers, num_stages, layers_per_stage)
    if not cuts:
        return model, None
    codec = boundary_codec(activation_codec, hidden_size=model.hidden_size, ratio=activation_ratio,
                           vocab_size=model.vocab_size, batch=batch_size, seq=seq_len)
    return dataclasses.replace(model, boundary=BoundaryConfig(codec.kind, codec.width, cuts)), codec
