"""Cutting the decoder into pipeline stages.

Stage 0 holds the token embedding and its blocks; the last stage holds the final norm,
the LM head and the loss. Initialisation is seeded per parameter *name*, so a stage
built alone has exactly the weights that the same layers have in the unsplit model,
and every peer of a stage starts from the same point without talking.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from swarm_node.model.boundary import (
    Boundaries,
    SubspaceEmbedding,
    SubspaceLinear,
    constrained_layers,
    init_boundary,
)
from swarm_node.model.config import ModelConfig
from swarm_node.model.llama import DecoderLayer, RMSNorm, RotaryEmbedding
from swarm_node.model.loss import LOSS_CHUNK_LOGITS, head_loss, lm_loss

__all__ = ["PipelineStage", "build_model", "build_stage", "init_weights", "lm_loss", "split_layers",
           "stage_cuts"]


def split_layers(num_layers: int, num_stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> tuple[range, ...]:
    """Global layer indices held by each stage: an even split (earlier stages take the
    remainder) or an explicit list. First and last stages may hold no blocks (embedding-
    or head-only stages); middle stages must hold at least one."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if layers_per_stage is None:
        if num_stages > num_layers and num_stages > 2:
            raise ValueError(f"cannot split {num_layers} layers evenly into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ValueError(f"layers_per_stage has {len(counts)} entries for {num_stages} stages")
        if sum(counts) != num_layers or any(c < 0 for c in counts):
            raise ValueError(f"layers_per_stage {counts} must be non-negative and sum to {num_layers}")
        if any(c == 0 for c in counts[1:-1]):
            raise ValueError(f"middle stages need at least one layer: {counts}")
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(num_stages))


def stage_cuts(num_layers: int, num_stages: int,
               layers_per_stage: Sequence[int] | None = None) -> tuple[int, ...]:
    """Where the stage boundaries sit: the global layer index each stage after the first
    starts at."""
    return tuple(r.stop for r in split_layers(num_layers, num_stages, layers_per_stage)[:-1])


class _Body(nn.Module):
    """Container whose attribute names give Hugging Face's ``model.*`` prefix."""


class PipelineStage(nn.Module):
    """One stage. ``forward(token_ids_or_hidden, targets=None)`` returns hidden states
    (B, T, H) for non-last stages, logits (B, T, V) for the last stage without
    targets, and the mean cross-entropy loss with them (over chunks of tokens when the
    logits exceed ``loss_chunk_logits`` elements, model/loss.py; None: never)."""

    loss_chunk_logits: int | None = LOSS_CHUNK_LOGITS

    def __init__(self, config: ModelConfig, stage_index: int, num_stages: int, layer_indices: range):
        super().__init__()
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_indices = layer_indices
        self.model = _Body()
        boundary = config.boundary
        subspace = boundary is not None and boundary.kind == "subspace"
        if self.is_first:
            self.model.embed_tokens = (SubspaceEmbedding(config.vocab_size, config.hidden_size,
                                                         boundary.width)
                                       if subspace else nn.Embedding(config.vocab_size, config.hidden_size))
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in layer_indices})
        for i in constrained_layers(boundary):
            if i in layer_indices:
                layer = self.model.layers[str(i)]
                width = boundary.width
                layer.self_attn.o_proj = SubspaceLinear(config.hidden_size, config.hidden_size, width)
                layer.mlp.down_proj = SubspaceLinear(config.intermediate_size, config.hidden_size, width)
        if self.is_last:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.boundaries: Boundaries | None = None
        self._inside: dict[int, int] = {}  # unsplit: global layer index -> boundary applied before it
        if boundary is not None:
            self.boundaries = self._boundaries(boundary, layer_indices)

    def _boundaries(self, boundary, layer_indices: range) -> Boundaries:
        """The model's boundaries this stage touches: a split model's stages are cut at
        exactly the boundaries; the unsplit model holds them all inside."""
        config, s, count = self.config, self.stage_index, len(boundary.cuts)
        if self.num_stages == 1:
            self._inside = {cut: i for i, cut in enumerate(boundary.cuts)}
            return Boundaries(boundary, config.hidden_size, config.vocab_size, range(count),
                              receives=None, sends=None)
        if count != self.num_stages - 1 or (s > 0 and boundary.cuts[s - 1] != layer_indices.start) \
                or (not self.is_last and boundary.cuts[s] != layer_indices.stop):
            raise ValueError(
                f"stage {s} holds layers {layer_indices.start}-{layer_indices.stop - 1}, which the "
                f"boundaries at {boundary.cuts} do not cut out"
            )
        receives, sends = (None if self.is_first else s - 1), (None if self.is_last else s)
        indices = range(s if self.is_first else s - 1, s if self.is_last else s + 1)
        return Boundaries(boundary, config.hidden_size, config.vocab_size, indices,
                          receives=receives, sends=sends)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: the (B, T) input ids, which a stage after the first needs when its
        boundary carries only a code (ModelConfig.boundary); stage 0 reads them from
        ``inputs``."""
        boundaries, token_part = self.boundaries, None
        if self.is_first:
            if inputs.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"stage 0 expects token ids, got {inputs.dtype}")
            tokens = inputs
            hidden = self.model.embed_tokens(inputs)  # (B, T, H)
            if boundaries is not None:
                token_part = boundaries.first_token_part(tokens, hidden)
                if boundaries.config.kind == "subspace":
                    hidden = hidden + token_part
        elif boundaries is not None:
            if tokens is None or tokens.shape != inputs.shape[:2]:
                raise ValueError("a stage after a coded boundary needs the token ids of its inputs")
            hidden, token_part = boundaries.rebuild(boundaries.receives, inputs, tokens)
        else:
            hidden = inputs
        if hidden.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {hidden.shape[1]} exceeds max_seq_len {self.config.max_seq_len}"
            )
        for index, layer in self.model.layers.items():
            if int(index) in self._inside:
                hidden, token_part = self._across(self._inside[int(index)], hidden, token_part, tokens)
            hidden = layer(hidden, self.rotary)
        end = self._inside.get(self.layer_indices.stop)  # a boundary after the last block (unsplit)
        if end is not None:
            hidden, token_part = self._across(end, hidden, token_part, tokens)
        if not self.is_last:
            return hidden if boundaries is None else boundaries.code(boundaries.sends, hidden, token_part)
        hidden = self.model.norm(hidden)
        if targets is None:
            return self.lm_head(hidden)  # (B, T, V)
        return head_loss(hidden, self.lm_head, targets, self.loss_chunk_logits)

    def _across(self, index: int, hidden: torch.Tensor, token_part: torch.Tensor,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boundary ``index`` inside the unsplit model: coded and rebuilt, as the split
        model's stages do it on either side (without the wire's rounding)."""
        return self.boundaries.rebuild(index, self.boundaries.code(index, hidden, token_part), tokens)


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_weights(stage: PipelineStage, seed: int) -> None:
    """Deterministic, name-keyed init: normal(0, init_std), residual output projections
    scaled by 1/sqrt(2 * num_layers) (GPT-2), norms at one."""
    config = stage.config
    residual_std = config.init_std / math.sqrt(2 * config.num_layers)
    done = set()  # boundary parts draw their own (model/boundary.py)
    for module_name, module in stage.named_modules():
        if init_boundary(module, module_name, seed, config.init_std):
            done |= {id(p) for p in module.parameters()}
    for name, param in stage.named_parameters():
        if id(param) in done:
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else config.init_std
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        param.copy_(values.to(param.dtype))


def build_stage(config: ModelConfig, *, num_stages: int, stage_index: int, seed: int,
                layers_per_stage: Sequence[int] | None = None,
                device: torch.device | str | None = None) -> PipelineStage:
    layers = split_layers(config.num_layers, num_stages, layers_per_stage)[stage_index]
    stage = PipelineStage(config, stage_index, num_stages, layers)
    init_weights(stage, seed)
    return stage.to(device) if device is not None else stage


def build_model(config: ModelConfig, *, seed: int, device: torch.device | str | None = None) -> PipelineStage:
    """The unsplit model: a single stage holding everything."""
    return build_stage(config, num_stages=1, stage_index=0, seed=seed, device=device)
