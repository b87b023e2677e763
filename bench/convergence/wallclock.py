"""Time to a target loss on a link: the inner steps each method needs (measured in the
runs) times what one step costs there, in units of one inner step's compute.

A link is one number, ``payload_steps``: how many inner steps of compute one 16-bit copy
of a stage's weights takes to cross it. The home-link benchmark measures it (its rate is
chosen so that the blocking 16-bit round takes several times the H inner steps: the
situation of a volunteer on a home uplink). What a step costs, by method:

- DDP: an all-reduce of the 16-bit gradients every step;
- DiLoCo as the paper models it: an all-reduce of the 16-bit Delta every H steps, blocking;
- NoLoCo as the paper models it: phi and Delta (16 bits) to and from one random peer
  every H steps, blocking;
- either as this project's node runs it: the compressed round beside the inner steps,
  at the compute utilisation the home-link benchmark measured for that method, waiting
  only where the round (as measured there, boundary to outer step) outlasts the H
  steps. NoLoCo's round moves one partner's payload whatever the stage's size; DiLoCo's
  gathers every other peer's, so at DP peers it is the measured one times
  (DP - 1) / (measured peers - 1): on a home uplink the bytes, not the round trips, set
  its length;
- local: nothing.

All-reduce and pair exchange follow the paper's latency model (section 5.3, the
project's bench/latency_model): the critical path of a binary-tree all-reduce among N
peers against one pair exchange, message times log-normal with std/mean ``cv``. The
barrier idle of DiLoCo and DDP (waiting for the slowest peer's inner steps) is left out,
which favours them. Activations between stages cost every method the same and are left
out too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.common.latency import pair_exchange_mean, sample_paths, tree_paths

MC_SAMPLES = 20_000


@dataclass(frozen=True)
class RoundHere:
    """One method's round as this project's node runs it (overlapped, compressed), measured."""
    round_steps: float  # boundary to outer step, in the link's inner steps of compute
    utilisation: float  # the compute share beside it
    peers: int  # the stage's peers it was measured among


@dataclass(frozen=True)
class Link:
    payload_steps: float  # one 16-bit copy of a stage's weights over the link, in inner steps of compute
    cv: float = 0.5  # message times' std / mean
    here: tuple[tuple[str, RoundHere], ...] = ()  # (method, its round as run here) where measured

    def round_here(self, method: str) -> RoundHere | None:
        return dict(self.here).get(method)


def link_from_home_link(summary: dict, cv: float = 0.5) -> Link | None:
    """The link of the home-link benchmark's result, where it has the figures: the link's
    step is a volunteer's of its main scenarios, and each method's measured round is
    counted in it."""
    if not (summary.get("payload_s_fp16") and summary.get("volunteer_step_s")):
        return None
    step_s = summary["volunteer_step_s"]
    here = tuple((method, RoundHere(round_steps=r["round_s"] / step_s, utilisation=r["utilisation"],
                                    peers=r["volunteers"]))
                 for method, r in (summary.get("rounds_as_run_here") or {}).items())
    return Link(payload_steps=summary["payload_s_fp16"] / step_s, cv=cv, here=here)


def allreduce_messages(n_peers: int, cv: float, seed: int = 0) -> float:
    """Mean critical path of a tree all-reduce among ``n_peers``, in message times."""
    if n_peers < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    return float(sample_paths(tree_paths, rng, n_peers, cv, MC_SAMPLES).mean(dtype=np.float64))


def step_cost(method: str, dp: int, inner_steps: int, link: Link, *, as_run_here: bool = False) -> float:
    """One inner step's wall time, in inner steps of compute (1.0: compute only)."""
    if method == "local":
        return 1.0
    if method == "ddp":
        return 1.0 + allreduce_messages(dp, link.cv) * link.payload_steps
    if method not in ("noloco", "diloco"):
        raise ValueError(f"no step cost for {method!r}")
    if as_run_here:
        measured = link.round_here(method)
        if measured is None:
            raise ValueError(f"the link has no measured {method} round")
        round_steps = measured.round_steps
        if method == "diloco":
            round_steps *= (dp - 1) / (measured.peers - 1)
        return max(1.0 / measured.utilisation, round_steps / inner_steps)
    if method == "diloco":
        return 1.0 + allreduce_messages(dp, link.cv) * link.payload_steps / inner_steps
    return 1.0 + pair_exchange_mean(link.cv) * 2 * link.payload_steps / inner_steps


def wall_rows(to_target: list[dict], link: Link) -> list[dict]:
    """Per grid and method, the wall time to the target loss on ``link``, in inner steps
    of compute; NoLoCo and DiLoCo twice (the paper's blocking round, and this project's
    where measured), each against DiLoCo's time with the same kind of round on the same
    grid (DDP and local: against the paper's)."""
    rows = []
    for r in to_target:
        outer = r["method"] in ("noloco", "diloco")
        variants = [("paper", False), ("as run here", True)] if outer else [("", False)]
        for label, here in variants:
            if here and link.round_here(r["method"]) is None:
                continue
            cost = step_cost(r["method"], r["dp"], r["inner_steps"], link, as_run_here=here)
            rows.append({"kind": "wall", "grid": r["grid"], "dp": r["dp"], "method": r["method"],
                         "setting": r.get("setting", ""), "round": label,
                         "steps": r["steps"], "step_cost": cost,
                         "wall_steps": None if r["steps"] is None else r["steps"] * cost})
    diloco = {(r["grid"], r["round"]): r["wall_steps"] for r in rows if r["method"] == "diloco"}
    for r in rows:
        reference = diloco.get((r["grid"], r["round"] or "paper"))
        r["vs_diloco"] = None if reference is None or r["wall_steps"] is None else r["wall_steps"] / reference
    return rows
