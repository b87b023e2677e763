"""Fault injection for ``swarm-node local --chaos-kills N --chaos-restarts M``: which nodes
die when, and which come back. The swarm does the killing and the restarting; this is
the schedule, drawn from the seed alone."""

from __future__ import annotations

import random
from dataclasses import dataclass

Node = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True)
class ChaosPlan:
    """SIGKILL ``kills`` random nodes (their whole process group, as a machine dying
    would) at random moments while stage 0 is between ``window`` fractions of its
    steps, and start ``restarts`` of them again from their checkpoints
    ``restart_delay_s`` later."""
    kills: int = 0
    restarts: int = 0
    seed: int = 0
    window: tuple[float, float] = (0.15, 0.5)
    restart_delay_s: float = 2.0


class ChaosSchedule:
    def __init__(self, plan: ChaosPlan | None, num_stages: int, replicas: int, steps: int):
        self.plan = plan
        self.steps = steps
        self._kills: list[tuple[float, Node]] = []  # (fraction of steps, node)
        self._restarts: list[tuple[float, Node]] = []  # (monotonic time, node)
        self._to_restart: set[Node] = set()
        if plan is None or plan.kills == 0:
            return
        rng = random.Random(plan.seed)
        nodes = [(s, r) for s in range(num_stages) for r in range(replicas)]
        targets = rng.sample(nodes, min(plan.kills, len(nodes)))
        moments = sorted(rng.uniform(*plan.window) for _ in targets)
        self._kills = list(zip(moments, targets))
        self._to_restart = set(targets[: plan.restarts])

    def kills_due(self, stage0_step: int | None, now: float) -> list[Node]:
        """Nodes to kill now that stage 0 is at ``stage0_step``; those to be restarted are
        scheduled for it."""
        due = []
        while self._kills and stage0_step is not None and stage0_step >= self._kills[0][0] * self.steps:
            _, node = self._kills.pop(0)
            due.append(node)
            if node in self._to_restart:
                self._restarts.append((now + self.plan.restart_delay_s, node))
        return due

    def restarts_due(self, now: float) -> list[Node]:
        due = []
        while self._restarts and self._restarts[0][0] <= now:
            due.append(self._restarts.pop(0)[1])
        return due

    @property
    def restarts_pending(self) -> bool:
        return bool(self._restarts)
