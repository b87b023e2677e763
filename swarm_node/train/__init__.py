"""A node's training: the stage and its optimizers (worker.py), the data path that feeds
it (pipeline.py), the hand-over to outer rounds (rounds.py), the compute thread, the
screens on what neighbours send, devices and evaluation."""
