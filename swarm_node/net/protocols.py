"""Protocol names of the node's stream handlers; docs/PROTOCOL.md documents each message.
The version suffix changes whenever a message layout changes."""

FORWARD = "/swarm-node/forward/1.0.0"  # activations + targets in, input gradient + loss out
OUTER = "/swarm-node/outer/1.0.0"  # phi + Delta both ways, one exchange per round
STATE = "/swarm-node/state/1.0.0"  # chunked snapshot of theta, phi, momentum and counters
STATUS = "/swarm-node/status/1.0.0"  # run id, stage, version, peer counts: for probes and other implementations
