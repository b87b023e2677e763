"""A hostile state donor for tests: a real `swarm-node join` that trains and pairs like
any peer, and sketches its own state honestly when asked, but serves joiners a
poisoned state (issue 33). The case is read from the file named by HOSTILE_CASE_FILE
at every snapshot, so one hostile peer serves a run's joiners case after case:

- ``scaled``: theta and phi times 1.5
- ``noise``: theta and phi plus Gaussian noise at 10x the honest spread (per element,
  the RMS of the distance between its phi and its partners', as it last counted them)
- ``tensor``: one tensor (the largest) of theta and phi replaced by fresh random values
- ``old``: theta, phi and momentum of 20 rounds ago, with today's counters
- ``other-run``: the initial weights of another run's seed, with today's counters
- ``honest``: its own state

The digest matches what it serves: the transfer itself is flawless."""

from __future__ import annotations

import collections
import math
import os
import sys
from pathlib import Path

import torch

from swarm_node.cli import main as cli
from swarm_node.model.stages import build_stage
from swarm_node.state import sync
from swarm_node.train.worker import StageWorker, tensor_digest

CASE_FILE = Path(os.environ["HOSTILE_CASE_FILE"])
OLD_ROUNDS = 20
honest_snapshot = StageWorker.snapshot
honest_close = StageWorker.close_round
# (theta, phi, momentum) after each round
history: collections.deque = collections.deque(maxlen=OLD_ROUNDS + 1)
spread: list[float] = []  # per-element RMS of the last partner distance seen


def recording_close(self, others):
    before = [t.float().cpu() for t in self.slow.phi]
    for phi, _ in others:  # a partner's phi as it counted: the honest spread
        numel = sum(t.numel() for t in phi)
        apart = math.sqrt(sum(float((t.float().cpu() - o).pow(2).sum()) for t, o in zip(phi, before)))
        spread.append(apart / math.sqrt(numel))
    honest_close(self, others)
    history.append(([p.detach().float().cpu().clone() for p in self.params],
                    [t.cpu().clone() for t in self.slow.phi],
                     [t.cpu().clone() for t in self.slow.momentum]))


def poisoned_snapshot(self) -> dict:
    snapshot = honest_snapshot(self)
    case = CASE_FILE.read_text().strip() if CASE_FILE.exists() else "honest"
    n = len(self.params)
    theta, phi, momentum = (snapshot["tensors"][i * n:(i + 1) * n] for i in range(3))
    if case == "scaled":
        theta, phi = [1.5 * t for t in theta], [1.5 * t for t in phi]
    elif case == "noise":
        sigma = 10 * max(spread[-4:] or [1e-3])
        noise = [sigma * torch.randn_like(t) for t in phi]
        theta, phi = [t + e for t, e in zip(theta, noise)], [t + e for t, e in zip(phi, noise)]
    elif case == "tensor":
        biggest = max(range(n), key=lambda k: theta[k].numel())
        fresh = torch.randn_like(theta[biggest]) * float(theta[biggest].std())
        theta, phi = list(theta), list(phi)
        theta[biggest], phi[biggest] = fresh, fresh.clone()
    elif case == "old":
        if len(history) <= OLD_ROUNDS:
            raise RuntimeError(f"only {len(history)} rounds of history")
        theta, phi, momentum = history[0]
    elif case == "other-run":
        stage = build_stage(self.stage.config, num_stages=self.spec.num_stages,
                            stage_index=self.stage.stage_index,
                            seed=self.spec.seed + 7919, layers_per_stage=self.spec.layers_per_stage)
        theta = [p.detach().float().clone() for p in stage.parameters()]
        phi, momentum = [t.clone() for t in theta], [torch.zeros_like(t) for t in theta]
    tensors = [*theta, *phi, *momentum, *snapshot["tensors"][3 * n:]]  # the moments as they are
    print(f"hostile: serving a {case} state", file=sys.stderr, flush=True)
    return {**snapshot, "tensors": tensors, "digest": tensor_digest(tensors)}


if __name__ == "__main__":
    sync.MAX_SNAPSHOTS = 64  # an attacker serves every joiner that asks, case after case,
    sync.SHARE_S = 0.0  # each a snapshot of its own
    StageWorker.snapshot = poisoned_snapshot
    StageWorker.close_round = recording_close
    sys.exit(cli.main(sys.argv[1:]))
