"""`swarm-node probe`: check a node from outside with another libp2p implementation.

The probe itself is ``libp2p_probe.py``, a standalone script for py-libp2p (PyPI
``libp2p``, trio), with its frame code beside it (``probe_frames.py``). It imports nothing
from swarm_node and runs in its own virtual environment and process: py-libp2p and
hivemind register the same protobuf package and pin protobuf differently, so they can
share neither a process nor an environment. ``swarm_node.cli.probe`` creates that
environment and runs the script."""

from pathlib import Path

SCRIPT = Path(__file__).with_name("libp2p_probe.py")
