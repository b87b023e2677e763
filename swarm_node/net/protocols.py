"""Protocol names of the node's stream handlers (see docs of each handler in node.py).
The version suffix changes whenever a message layout changes."""

FORWARD = "swarm-node/forward/1"  # activations + targets in, input gradient + loss out
OUTER = "swarm-node/outer/1"  # phi + Delta both ways, one exchange per round
STATE = "swarm-node/state/1"  # chunked snapshot of theta, phi, momentum and counters
