"""Per-node training state: the stage, its optimizers, gradient accumulation and evaluation."""
