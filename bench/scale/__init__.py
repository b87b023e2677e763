"""Benchmark: the swarm at N = 16 ... 1024 peers a stage (swarm_node/scale), and what
hivemind's DHT costs per registry operation (dht_costs.py)."""
