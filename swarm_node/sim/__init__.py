"""The in-process swarm simulator: many workers and stages in one process."""

from swarm_node.sim.config import SimConfig
from swarm_node.sim.simulator import Simulator, SimResult, StepReport

__all__ = ["SimConfig", "SimResult", "Simulator", "StepReport"]
