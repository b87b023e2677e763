"""``swarm-node local``: a whole swarm on this machine, for demos and research.
``swarm.py`` starts a bootstrap DHT and the node processes, watches them and stops
them; ``procs.py`` the node processes themselves (finished, dead or lost); ``evaluation.py``
the final evaluation on the run's device; ``chaos.py`` the chaos mode's schedule."""
