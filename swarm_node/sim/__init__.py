"""The in-process swarm simulator: many workers and stages in one process."""

from swarm_node.sim.config import SimConfig
from swarm_node.sim.simulator import SimResult, Simulator, StepReport

__all__ = ["SimConfig", "SimResult", "Simulator", "StepReport"]
