"""Protocol names of the node's stream handlers; docs/PROTOCOL.md documents each message.
The version suffix changes whenever a message layout changes."""

# activations + targets in, input gradient + loss out; both bodies paced (3.0, net/pacing.py),
# so that on a full home uplink proposals, heartbeats and outer payloads pass beside them
FORWARD = "/swarm-node/forward/3.0.0"
PAIR = "/swarm-node/pair/1.0.0"  # a few bytes: "pair with me this round?", answered before any payload moves
# phi + Delta, one exchange per round, only after PAIR accepts: the caller's payload goes
# in on OUTER (paced; the answer is the partner's verdict) while it fetches the partner's
# on OUTER_FETCH (paced), both at once (outer 3.0: the two directions no longer wait for
# each other); a pair's payload moves as two parts, Delta ahead of phi (outer 4.0, outer-fetch 2.0)
OUTER = "/swarm-node/outer/4.0.0"
OUTER_FETCH = "/swarm-node/outer-fetch/2.0.0"
STATE = "/swarm-node/state/3.0.0"  # chunked snapshot of theta, phi, momentum, Adam moments, counters, coded
# a count sketch of our state under a joiner's seed: how a joiner checks the state it downloaded
STATE_SKETCH = "/swarm-node/state-sketch/1.0.0"
# run id, stage, version, peer counts: for probes and other implementations
STATUS = "/swarm-node/status/1.0.0"
# a prepared dataset (data/serve.py): its manifest, which of its files a peer holds, and
# chunks of them, each checked against the manifest by the caller (data 2.0: `have` is a bitmap)
DATA = "/swarm-node/data/2.0.0"
# a direct lane's offer (net/lanes.py): its port, certificate hash and a ticket for the caller
# (2.0: the ticket opens a lane with proofs both ways, net/lane_auth.py)
LANE = "/swarm-node/lane/2.0.0"
# what may travel on a direct lane: the protocols whose bodies are model-sized
BULK = frozenset({FORWARD, OUTER, OUTER_FETCH, STATE})
