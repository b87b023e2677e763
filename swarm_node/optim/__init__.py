"""Optimizer math in pure torch: the inner AdamW loop and the NoLoCo/DiLoCo outer step."""

from swarm_node.optim.ddp import average_gradients
from swarm_node.optim.inner import InnerHyper, InnerOptimizer, lr_at
from swarm_node.optim.methods import METHODS, MethodSpec, default_method
from swarm_node.optim.outer import OuterHyper, SlowWeights, group_mean, outer_update

__all__ = [
           "METHODS",
           "InnerHyper",
           "InnerOptimizer",
           "MethodSpec",
           "OuterHyper",
           "SlowWeights",
           "average_gradients",
           "default_method",
           "group_mean",
           "lr_at",
           "outer_update",
]
