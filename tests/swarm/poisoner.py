"""A hostile peer for tests: a real `swarm-node join` whose outer payload carries a
constant added to every element of phi and Delta, its norm POISON_SCALE times the
honest Delta norm of that round (the red team's attack in issue 15)."""

from __future__ import annotations

import math
import os
import sys

from swarm_node.cli import main as cli
from swarm_node.wire.outer_codec import OuterEncoder

SCALE = float(os.environ.get("POISON_SCALE", "5"))
honest_encode = OuterEncoder.encode


def poisoned_encode(self, phi, delta):
    numel = sum(t.numel() for t in delta)
    delta_norm = math.sqrt(sum(float(t.float().pow(2).sum()) for t in delta))
    offset = SCALE * delta_norm / math.sqrt(numel)
    return honest_encode(self, [t + offset for t in phi], [t + offset for t in delta])


if __name__ == "__main__":
    OuterEncoder.encode = poisoned_encode
    sys.exit(cli.main(sys.argv[1:]))
