"""The virtual-clock event loop lives in swarm_node/scale/vclock.py (the swarm-scale
simulator runs on it); tests import it as ``vclock``."""

from swarm_node.scale.vclock import VirtualClockLoop, run, virtual_clock

__all__ = ["VirtualClockLoop", "run", "virtual_clock"]
