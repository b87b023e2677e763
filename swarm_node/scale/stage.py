"""A stage worker without a model: the real worker's outer-round code (open the round,
our payload as partners decode it, decode theirs, the outer step, the round counters)
over a few weights, moved by a stand-in for training so that every peer's Delta has a
realistic scale and the partner checks (gossip/partner_check.py) run on real numbers."""

from __future__ import annotations

import torch

from swarm_node.optim.outer import SlowWeights
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker
from swarm_node.wire.outer_codec import OuterEncoder, outer_codec

WEIGHTS = 32  # enough for the codec's blocks and a norm to screen; cheap for 2,048 peers
MOVES_DRAWN = 64  # inner steps' moves drawn at once


class TinyStage(StageWorker):
    """StageWorker's outer round on ``WEIGHTS`` weights. An inner step moves them along
    the stage's common direction (what every peer's data agrees on) plus the peer's
    own noise, ``lr`` per step."""

    # StageWorker.__init__ would build a model
    def __init__(self, spec: RunSpec, stage_index: int, seed: int, lr: float = 1e-3):
        self.spec = spec
        self.device = torch.device("cpu")
        common = torch.Generator().manual_seed(1000 + stage_index)
        self.params = [torch.nn.Parameter(torch.randn(WEIGHTS, generator=common))]
        self.direction = torch.randn(WEIGHTS, generator=common)
        self.noise = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.slow = SlowWeights(self.params, spec.method.outer)
        self.codec = outer_codec(spec.outer_codec)
        self.encoder = OuterEncoder(self.codec)
        self.open = None
        self._own_decoded = None
        self.outer_round = 0
        self.last_round_step = 0
        self.round_forced = False
        self._steps = 0
        self._moves, self._moves_left = None, 0
        self._weights = self.params[0].detach()  # the same storage, outside autograd (as under no_grad)

    @property
    def inner_step(self) -> int:
        return self._steps

    def step(self) -> int:
        if self._moves_left == 0:  # drawn a block at a time: one small torch op a step, not four
            self._moves = self.lr * (self.direction + torch.randn(MOVES_DRAWN, WEIGHTS, generator=self.noise))
            self._moves_left = MOVES_DRAWN
        self._moves_left -= 1
        self._weights.add_(self._moves[self._moves_left])
        self._steps += 1
        return self._steps

    @torch.no_grad()
    def take_state_of(self, donor: TinyStage) -> None:
        """A late joiner's state download, done in memory: the donor's weights, outer
        state and counters (the real download is state/sync.py; its bytes are not
        control traffic)."""
        self.params[0].copy_(donor.params[0])
        self.slow.load_state_dict({"phi": donor.slow.phi, "momentum": donor.slow.momentum})
        self.outer_round, self._steps = donor.outer_round, donor.inner_step
        self.last_round_step = donor.last_round_step
