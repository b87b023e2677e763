"""A hostile peer for tests: a real `swarm-node join` that adds a constant to every
element of the phi and Delta it sends, the constant SHIFT_SCALE * ||Delta|| / sqrt(n)
for its own honest Delta of that round (so the Delta it sends is about SHIFT_SCALE
times an honest one), while its own outer step stays honest: it keeps what it would
have sent (and its error feedback) for itself, and encodes the shifted copy with an
encoder of its own. Unlike tests/swarm/poisoner.py, whose own step takes the offset
too, it keeps training as an honest peer would: its rounds, its pace and its Delta
norm stay an honest peer's."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

from swarm_node.cli import main as cli
from swarm_node.train.worker import StageWorker
from swarm_node.wire.outer_codec import OuterEncoder

SCALE = float(os.environ.get("SHIFT_SCALE", "5"))
honest_open_round = StageWorker.open_round


@torch.no_grad()
def shifted_open_round(self: StageWorker, overlapped: bool = False):
    phi = [t.clone() for t in self.slow.phi]
    delta = self.slow.deltas()
    opened = honest_open_round(self, overlapped)
    self.own_payload()  # the honest payload, decoded: our own scale, checks and step
    numel = sum(t.numel() for t in delta)
    offset = SCALE * math.sqrt(sum(float(t.pow(2).sum()) for t in delta)) / math.sqrt(numel)
    if not hasattr(self, "shift_encoder"):
        self.shift_encoder = OuterEncoder(self.codec)
        self.shift_encoder.seen = self.encoder.seen  # the honest encoder's distances to partners
    wire = self.shift_encoder.encode([t + offset for t in phi], [t + offset for t in delta])
    self.shift_encoder.commit()
    self.open = dataclasses.replace(opened, wire=wire)
    return self.open


if __name__ == "__main__":
    StageWorker.open_round = shifted_open_round
    sys.exit(cli.main(sys.argv[1:]))
