"""Model hyper-parameters and the named sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from swarm_node.model.boundary import BoundaryConfig


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. Vocabulary and sequence length come from the data."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    # What crosses stage boundaries, when not the whole hidden state (model/boundary.py)
    boundary: BoundaryConfig | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.boundary is not None and self.boundary.cuts[-1] > self.num_layers:
            raise ValueError(f"a stage boundary after layer {self.boundary.cuts[-1]} of {self.num_layers}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


# hidden, layers, heads, kv heads, feed-forward. Feed-forward follows Llama's
# round_up(8h/3, 256) for the paper's sizes; debug, mini and tiny are sized for CPUs
# (mini sits between the two for bench/size_trend: about 8x debug's and a quarter of
# tiny's parameters outside the embeddings).
NAMED_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "debug": (64, 2, 4, 4, 192),
    "mini": (128, 4, 4, 4, 384),
    "tiny": (256, 4, 4, 4, 768),
    "small": (768, 12, 12, 12, 2048),
    "medium": (2048, 24, 16, 16, 5632),
    "large": (4096, 32, 32, 32, 11008),
}


def model_config(size: str, *, vocab_size: int, max_seq_len: int, **overrides) -> ModelConfig:
    """The named size ``size`` for the given data, with optional field overrides
    (for example ``num_kv_heads=2`` for grouped-query attention)."""
    try:
        hidden, layers, heads, kv_heads, ffn = NAMED_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(NAMED_SIZES)}") from None
    config = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         intermediate_size=ffn, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return dataclasses.replace(config, **overrides) if overrides else config
