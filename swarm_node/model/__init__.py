"""Llama-style decoder in plain torch, cut into pipeline stages."""

from swarm_node.model.config import NAMED_SIZES, ModelConfig, model_config
from swarm_node.model.stages import PipelineStage, build_model, build_stage, lm_loss, split_layers

__all__ = ["NAMED_SIZES", "ModelConfig", "PipelineStage", "build_model", "build_stage", "lm_loss",
           "model_config", "split_layers"]
