"""A poisoning peer inside the simulator, screened by the node's own PartnerCheck.

Every worker of the attacked stage checks its partner's (phi, Delta) the way a node
does (gossip/partner_check.py, fed its own Delta at the start of each round), takes the
local-only step when it rejects, and never pairs with a rejected partner again (a
poisoner is banned for long: net/guard.py). One worker of the stage is the attacker:
it sends its honest phi and Delta with a constant added to every element, the
constant's norm ``scale`` times the honest Delta norm of that round (growing by
``growth`` per round when given: an attacker that creeps up on the bound)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from swarm_node.errors import ProtocolError
from swarm_node.gossip.pairing import Refused
from swarm_node.gossip.partner_check import PartnerCheck, distance, norm
from swarm_node.sim import SimConfig, Simulator
from swarm_node.sim.grouping import random_groups
from swarm_node.train.evaluate import path_val_loss


@dataclass
class AttackReport:
    accepted_attacks: int = 0  # exchanges in which an honest worker took the attacker's payload
    rejected_attacks: int = 0
    honest_rejections: int = 0  # an honest worker refusing another honest one
    honest_pairs: int = 0
    ratios: list[float] = field(default_factory=list)  # honest partners' Delta norm / own median
    distances: list[float] = field(default_factory=list)  # honest partners' phi distance / own median


class AttackedSimulator(Simulator):
    def __init__(self, config: SimConfig, *, stage: int = 1, attacker: int | None = None, scale: float = 5.0,
                 growth: float = 0.0, max_update_ratio: float = 3.0, clip_ratio: float = 1.5):
        super().__init__(config)
        self.attacked_stage, self.attacker = stage, attacker
        self.scale, self.growth = scale, growth
        self.checks = [PartnerCheck(max_update_ratio, clip_ratio) for _ in range(config.replicas)]
        self.banned: set[tuple[int, int]] = set()  # (honest worker, partner it will not pair with)
        self.report = AttackReport()

    def outer_round(self) -> None:
        workers = self.workers[self.attacked_stage]
        phis = [w.slow.phi for w in workers]
        deltas = [w.slow.deltas() for w in workers]
        sent = [(phi, delta) for phi, delta in zip(phis, deltas)]
        if self.attacker is not None:
            sent[self.attacker] = self._poisoned(phis[self.attacker], deltas[self.attacker])
        for i in range(len(workers)):
            if i != self.attacker:
                self.checks[i].note_own_delta(deltas[i])
        for group in random_groups(len(workers), 2, self.rng):
            for i in group:
                partners = [j for j in group if j != i and (i, j) not in self.banned]
                taken = [sent[j] if i == self.attacker else self._checked(i, j, sent[j]) for j in partners]
                members = [(phis[i], deltas[i]), *(payload for payload in taken if payload is not None)]
                workers[i].slow.apply([phi for phi, _ in members], [delta for _, delta in members])
        for s, stage_workers in enumerate(self.workers):  # the other stages as usual
            if s != self.attacked_stage:
                self._plain_round(stage_workers)
        self.outer_rounds += 1

    def _checked(self, i: int, j: int, payload):
        """What worker ``i`` takes of partner ``j``'s payload (clipped), or None."""
        phi, delta = payload
        check = self.checks[i]
        own = self.workers[self.attacked_stage][i].slow
        try:
            taken = check.check([*phi, *delta], own.phi, own.deltas)
        except (ProtocolError, Refused):
            self.banned.add((i, j))
            if j == self.attacker:
                self.report.rejected_attacks += 1
            else:
                self.report.honest_rejections += 1
            return None
        if j == self.attacker:
            self.report.accepted_attacks += 1
        else:
            self.report.honest_pairs += 1
            reference = check.reference()
            if reference:
                self.report.ratios.append(norm(delta) / reference)
                self.report.distances.append(distance(phi, own.phi) / reference)
        return taken

    def _poisoned(self, phi, delta):
        scale = self.scale + self.growth * self.outer_rounds
        numel = sum(t.numel() for t in delta)
        offset = scale * norm(delta) / math.sqrt(numel)
        return [t + offset for t in phi], [t + offset for t in delta]

    def _plain_round(self, stage_workers) -> None:
        phis = [w.slow.phi for w in stage_workers]
        deltas = [w.slow.deltas() for w in stage_workers]
        for group in random_groups(len(stage_workers), 2, self.rng):
            for i in group:
                order = [i] + [j for j in group if j != i]
                stage_workers[i].slow.apply([phis[j] for j in order], [deltas[j] for j in order])


def honest_val_loss(sim: Simulator, stage: int, skip: int | None) -> float:
    """Mean validation loss over the paths through the honest workers of ``stage``."""
    cfg = sim.config
    losses = [path_val_loss([sim.workers[s][r].stage for s in range(cfg.stages)], sim.data,
                            batch_size=cfg.eval_batch_size, max_batches=cfg.eval_batches)
              for r in range(cfg.replicas) if r != skip]
    return sum(losses) / len(losses)
