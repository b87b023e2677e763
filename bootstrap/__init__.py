"""``swarm-bootstrap``: the bootstrap peer of a public run (a DHT peer that trains
nothing), with the run spec, a reachability check and a status dashboard. A thin
program over swarm_node's network layer; installed as the package ``swarm_bootstrap``."""
