"""A stage's training state beyond the running process: checkpoint files (checkpoint.py),
when to write and resume them (keeper.py), and downloading a live peer's state when
joining late (sync.py)."""
