"""A coded stage boundary against fp16 activations at equal tokens (issue 55)."""
