"""swarm_node: peer-to-peer swarm training of language models with NoLoCo.

Layers point one way: ``model`` and ``optim`` are pure torch; ``data`` reads tokens;
``sim`` wires them in one process; the network layer (``net``) is the only code that
imports hivemind; ``node.py`` wires a node's components; ``cli`` only parses.
"""

__version__ = "0.1.0"
