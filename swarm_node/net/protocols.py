"""Protocol names of the node's stream handlers; docs/PROTOCOL.md documents each message.
The version suffix changes whenever a message layout changes."""

FORWARD = "/swarm-node/forward/1.0.0"  # activations + targets in, input gradient + loss out
PAIR = "/swarm-node/pair/1.0.0"  # a few bytes: "pair with me this round?", answered before any payload moves
OUTER = "/swarm-node/outer/2.0.0"  # phi + Delta both ways, one exchange per round (2.0: only after PAIR accepts)
STATE = "/swarm-node/state/1.0.0"  # chunked snapshot of theta, phi, momentum and counters
STATUS = "/swarm-node/status/1.0.0"  # run id, stage, version, peer counts: for probes and other implementations
