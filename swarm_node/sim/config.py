"""Simulator settings."""

from __future__ import annotations

from dataclasses import dataclass

from swarm_node.data.spec import DataSpec
from swarm_node.model.stages import split_layers
from swarm_node.optim.inner import InnerHyper
from swarm_node.optim.methods import MethodSpec
from swarm_node.spec import SettingNames, check_model_split
from swarm_node.wire.activations import ACTIVATION_CODECS
from swarm_node.wire.boundary import BOUNDARY_CODECS
from swarm_node.wire.outer_codec import OUTER_CODECS

ROUTINGS = ("random", "fixed")
# Where an overlapped round's inner steps beside the exchange start (ALGORITHM.md 3.1):
# "local", the rule the node runs; "theta", theta as it was (no move at the boundary).
# The others are for analysis only, since no node knows its partners' payloads at the
# boundary: the group's outer step with their Delta known ("known-deltas"), with their
# phi known ("known-phis"), or with both ("known": the blocking step's weights).
OVERLAP_STARTS = ("local", "theta", "known-deltas", "known-phis", "known")
# How an overlapped round's payloads land: "whole", phi and Delta together when the
# exchange is done (the node today); "delta-first", Delta sent ahead of phi, so the
# group's Delta lands as far into the exchange as Delta's share of its bytes and moves
# theta then (SlowWeights.land_deltas), phi and the gamma pull when the rest is in; an
# exchange outlasting the round has its wait spent first, so the Delta lands that much
# sooner in the round's steps.
OUTER_LANDINGS = ("whole", "delta-first")
FIELD_NAMES = SettingNames(model="model_size", stages="stages", layers="layers_per_stage")


@dataclass(frozen=True)
class SimConfig:
    method: MethodSpec
    inner: InnerHyper
    data: DataSpec
    replicas: int = 4
    stages: int = 2
    model_size: str = "debug"
    num_layers: int | None = None  # the named size's width with this many layers (None: its own)
    layers_per_stage: tuple[int, ...] | None = None
    seq_len: int = 64
    batch_size: int = 8  # sequences per micro-batch; one micro-batch per worker per step
    steps: int = 1000  # inner optimizer steps per worker
    seed: int = 0
    routing: str = "random"  # fresh random path per micro-batch, or replica r always uses worker r
    activation_codec: str = "fp32"  # how activations and gradients cross stage boundaries (wire/messages.py)
    # A coded boundary's compression against fp16, everything on the wire counted
    # (wire/boundary.py); only with a boundary codec (bottleneck, subspace)
    activation_ratio: float | None = None
    outer_codec: str = "fp32"  # how phi and Delta go on the wire (wire/outer_codec.py); fp32: as they are
    # None: the blocking outer round. k: overlapped, the exchange lands k inner steps
    # after the boundary (at most H: a node whose exchange outlasts the next boundary
    # waits there, which costs time but no steps; with "delta-first" it waits first,
    # while the partner's Delta comes, and steps from the pair's Delta step).
    outer_latency_steps: int | None = None
    overlap_start: str = "local"
    outer_landing: str = "whole"
    # The NoLoCo reference code's input embedding never trains (the gradient it hands to
    # stage 0's input is zeros): True reproduces that, for the ablation (issue 36).
    freeze_input_embedding: bool = False
    eval_every_steps: int = 50
    eval_batches: int = 8
    eval_batch_size: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.stages < 1:
            raise ValueError("replicas and stages must be >= 1")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}")
        if self.activation_codec not in (*ACTIVATION_CODECS, *BOUNDARY_CODECS):
            raise ValueError(f"activation_codec must be one of {(*ACTIVATION_CODECS, *BOUNDARY_CODECS)}")
        if (self.activation_ratio is not None) != (self.activation_codec in BOUNDARY_CODECS):
            raise ValueError("activation_ratio goes with a boundary codec, and only with one")
        if self.outer_codec not in OUTER_CODECS:
            raise ValueError(f"outer_codec must be one of {tuple(OUTER_CODECS)}")
        if self.num_layers is None:
            check_model_split(self.model_size, self.stages, self.layers_per_stage, FIELD_NAMES)
        else:
            check_model_split(self.model_size, 1, None, FIELD_NAMES)
            split_layers(self.num_layers, self.stages, self.layers_per_stage)
        if self.outer_latency_steps is not None and self.outer_latency_steps < 0:
            raise ValueError("outer_latency_steps must be >= 0")
        if self.overlap_start not in OVERLAP_STARTS:
            raise ValueError(f"overlap_start must be one of {OVERLAP_STARTS}")
        if self.outer_landing not in OUTER_LANDINGS:
            raise ValueError(f"outer_landing must be one of {OUTER_LANDINGS}")

    @property
    def tokens_per_step(self) -> int:
        return self.replicas * self.batch_size * self.seq_len
