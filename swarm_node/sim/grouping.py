"""Random groups for one outer round of the simulator: a fresh permutation every round,
cut into groups of ``group_size``; a remainder of one worker does a local-only step.
(The networked node cannot see everyone at once and pairs differently; see the node.)"""

from __future__ import annotations

import numpy as np


def random_groups(num_workers: int, group_size: int, rng: np.random.Generator) -> list[list[int]]:
    order = [int(i) for i in rng.permutation(num_workers)]
    return [order[i:i + group_size] for i in range(0, num_workers, group_size)]
