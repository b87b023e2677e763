"""Training methods and their defaults (ALGORITHM.md sections 3 and 5)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm_node.optim.outer import OuterHyper

METHODS = ("noloco", "diloco", "ddp", "local")
# The NoLoCo paper's outer settings (ALGORITHM.md 3): what the benchmarks that reproduce
# its comparisons run, whatever the node's default is.
PAPER_NOLOCO = OuterHyper(alpha=0.5, beta=0.7, gamma=0.7)
# The node's NoLoCo default: the paper's beta and gamma with DiLoCo's outer momentum, so a
# steady Delta moves phi once a round (beta / (1 - alpha) = 1, against the paper's 1.4):
# ahead of the paper's at every size measured (ALGORITHM.md 3.4).
NOLOCO_OUTER = OuterHyper(alpha=0.3, beta=0.7, gamma=0.7)


@dataclass(frozen=True)
class MethodSpec:
    """How the workers of a stage keep in step.

    noloco: every ``inner_steps`` steps, an outer step within a random group of
    ``group_size`` (2 = pairs). diloco: an outer step over all workers of the stage
    (all-reduce). ddp: gradients averaged every step. local: no communication.
    """

    name: str = "noloco"
    inner_steps: int = 50  # H
    outer: OuterHyper | None = NOLOCO_OUTER
    group_size: int = 2

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}; choose one of {', '.join(METHODS)}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps (H) must be >= 1, got {self.inner_steps}")
        if self.name in ("noloco", "diloco") and self.outer is None:
            raise ValueError(f"{self.name} needs outer hyper-parameters")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")

    @property
    def has_outer_step(self) -> bool:
        return self.name in ("noloco", "diloco")


def default_method(name: str, *, inner_steps: int | None = None, alpha: float | None = None,
                   beta: float | None = None, gamma: float | None = None, nesterov: bool = False,
                   group_size: int = 2) -> MethodSpec:
    """The defaults for ``name``, with optional overrides. NoLoCo: NOLOCO_OUTER, H 50.
    DiLoCo: the paper's alpha 0.3, beta 0.7, H 100."""
    if name == "noloco":
        base = NOLOCO_OUTER
        h = 50
    elif name == "diloco":
        base = OuterHyper(alpha=0.3, beta=0.7, gamma=0.0, nesterov=nesterov)
        h = 100
    elif name in ("ddp", "local"):
        return MethodSpec(name=name, inner_steps=inner_steps or 1, outer=None, group_size=group_size)
    else:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    outer = OuterHyper(alpha=base.alpha if alpha is None else alpha, beta=base.beta if beta is None else beta,
                       gamma=base.gamma if gamma is None else gamma, nesterov=nesterov)
    return MethodSpec(name=name, inner_steps=inner_steps or h, outer=outer, group_size=group_size)
