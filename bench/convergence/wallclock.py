"""Time to a target loss on a link: the inner steps each method needs (measured in the
runs) times what one step costs there, in units of one inner step's compute.

A link is one number, ``payload_steps``: how many inner steps of compute one 16-bit copy
of a stage's weights takes to cross it. The home-link benchmark measures it (its rate is
chosen so that the blocking 16-bit round takes several times the H inner steps: the
situation of a volunteer on a home uplink). What a step costs, by method:

- DDP: an all-reduce of the 16-bit gradients every step;
- DiLoCo: an all-reduce of the 16-bit Delta every H steps, blocking;
- NoLoCo as the paper models it: phi and Delta (16 bits) to and from one random peer
  every H steps, blocking;
- NoLoCo as this project runs it: the compressed round beside the inner steps, at the
  compute utilisation the home-link benchmark measured, waiting only where the exchange
  (as measured there) outlasts the H steps;
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
class Link:
    payload_steps: float  # one 16-bit copy of a stage's weights over the link, in inner steps of compute
    cv: float = 0.5  # message times' std / mean
    overlapped_exchange_steps: float | None = None  # this project's compressed round, measured
    overlapped_utilisation: float | None = None  # compute share while it runs, measured


def link_from_home_link(summary: dict, cv: float = 0.5) -> Link | None:
    """The link of the home-link benchmark's result, where it has the figures."""
    needed = ("payload_s_fp16", "volunteer_step_s", "overlapped_compressed_exchange_s",
              "utilisation_overlapped_compressed")
    if not all(summary.get(k) for k in needed):
        return None
    step_s = summary["volunteer_step_s"]
    return Link(payload_steps=summary["payload_s_fp16"] / step_s, cv=cv,
                overlapped_exchange_steps=summary["overlapped_compressed_exchange_s"] / step_s,
                overlapped_utilisation=summary["utilisation_overlapped_compressed"])


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
    if method == "diloco":
        return 1.0 + allreduce_messages(dp, link.cv) * link.payload_steps / inner_steps
    if method != "noloco":
        raise ValueError(f"no step cost for {method!r}")
    if not as_run_here:
        return 1.0 + pair_exchange_mean(link.cv) * 2 * link.payload_steps / inner_steps
    if link.overlapped_exchange_steps is None or not link.overlapped_utilisation:
        raise ValueError("the link has no measured overlapped round")
    return max(1.0 / link.overlapped_utilisation, link.overlapped_exchange_steps / inner_steps)


def wall_rows(to_target: list[dict], link: Link) -> list[dict]:
    """Per grid and method, the wall time to the target loss on ``link``, in inner steps
    of compute; NoLoCo twice (the paper's blocking round and this project's), and each
    against DiLoCo's time on the same grid."""
    rows = []
    for r in to_target:
        variants = [("paper", False), ("as run here", True)] if r["method"] == "noloco" else [("", False)]
        for label, here in variants:
            if here and link.overlapped_exchange_steps is None:
                continue
            cost = step_cost(r["method"], r["dp"], r["inner_steps"], link, as_run_here=here)
            rows.append({"kind": "wall", "grid": r["grid"], "dp": r["dp"], "method": r["method"], "round": label,
                         "steps": r["steps"], "step_cost": cost,
                         "wall_steps": None if r["steps"] is None else r["steps"] * cost})
    for grid in {r["grid"] for r in rows}:
        diloco = next((r["wall_steps"] for r in rows if r["grid"] == grid and r["method"] == "diloco"), None)
        for r in rows:
            if r["grid"] == grid:
                r["vs_diloco"] = (None if diloco is None or r["wall_steps"] is None
                                  else r["wall_steps"] / diloco)
    return rows
