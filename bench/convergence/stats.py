"""The arithmetic of the convergence benchmark: per-seed runs -> per-grid and per-M
rows with spreads and gaps to DDP, and the checks of the papers' shape. Pure Python,
no torch, so it is unit-tested in milliseconds (tests/unit/test_bench_convergence.py).

A *run* is one simulator run, a flat dict with at least ``section`` ("tune", "grid",
"scaling" or "sweep"), ``dp``, ``pp``, ``method``, ``seed``, ``val_loss`` and ``ppl``
(over random paths: bench/convergence/runs.py)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

METHOD_ORDER = ("ddp", "noloco", "diloco", "local")

# ALGORITHM.md section 6: final validation perplexity on C4, Small model (125M),
# keyed by (DP, PP). FSDP is the paper's data-parallel baseline, our "ddp".
PAPER_SMALL_PPL: dict[tuple[int, int], dict[str, float]] = {
    (8, 1): {"ddp": 29.1, "diloco": 35.4, "noloco": 34.5},
    (4, 2): {"ddp": 29.1, "diloco": 32.1, "noloco": 31.3},
    (8, 2): {"ddp": 29.1, "diloco": 34.0, "noloco": 33.1},
    (16, 2): {"ddp": 29.1, "diloco": 39.1, "noloco": 37.7},
}

# ALGORITHM.md section 5 (Scaling Laws for DiLoCo): DiLoCo's eval loss over DP's at
# equal tokens, in %, by replicas M; and the best outer lr by M.
PAPER_SCALING_EXCESS_PCT: dict[str, dict[int, float]] = {
    "35M": {1: -0.1, 2: 0.7, 4: 2.0, 8: 3.9},
    "2.4B": {1: -0.4, 2: -0.1, 4: 0.3, 8: 1.1},
}
# Those outer lrs go with the DiLoCo papers' outer optimizer, Nesterov momentum 0.9
# (ALGORITHM.md section 5), not with the reference code's heavy-ball 0.3.
SCALING_OUTER_LR: dict[int, float] = {1: 0.4, 2: 0.6, 4: 0.6, 8: 0.8}
SCALING_OUTER_MOMENTUM = 0.9


def perplexity(loss: float) -> float:
    return math.exp(loss)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample std (0 for one value), min and max."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def paired_gaps_pct(values: dict[int, float], reference: dict[int, float]) -> list[float]:
    """Per seed, 100 * (value / reference - 1): the two runs of a seed share the
    initial weights and data order, so the paired gap is far less noisy than the means."""
    return [100.0 * (values[s] / reference[s] - 1.0) for s in sorted(values) if s in reference]


def _by_seed(runs: Iterable[dict], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in runs}


def _select(runs: Iterable[dict], **match) -> list[dict]:
    return [r for r in runs if all(r.get(k) == v for k, v in match.items())]


def grid_rows(runs: Sequence[dict]) -> list[dict]:
    """One row per (DP x PP grid, method): perplexity over seeds, gap to the grid's DDP
    (paired by seed), and the paper's numbers for the same grid where it has them."""
    grid_runs = _select(runs, section="grid")
    grids = sorted({(r["dp"], r["pp"]) for r in grid_runs}, key=lambda g: (g[1], g[0]))
    rows = []
    for dp, pp in grids:
        ddp_ppl = _by_seed(_select(grid_runs, dp=dp, pp=pp, method="ddp"), "ppl")
        paper = PAPER_SMALL_PPL.get((dp, pp), {})
        for method in METHOD_ORDER:
            mine = _select(grid_runs, dp=dp, pp=pp, method=method)
            if not mine:
                continue
            ppl = spread([r["ppl"] for r in mine])
            gaps = paired_gaps_pct(_by_seed(mine, "ppl"), ddp_ppl)
            paper_ppl = paper.get(method)
            rows.append({
                "kind": "grid", "dp": dp, "pp": pp, "grid": f"{dp} x {pp}", "method": method,
                "seeds": len(mine),
                "ppl_mean": ppl["mean"], "ppl_std": ppl["std"], "ppl_min": ppl["min"], "ppl_max": ppl["max"],
                "gap_to_ddp_pct": statistics.fmean(gaps) if gaps else None,
                "gap_min_pct": min(gaps) if gaps else None, "gap_max_pct": max(gaps) if gaps else None,
                "fixed_ppl_mean": statistics.fmean(perplexity(r.get("fixed_val_loss",
                                                                    r["val_loss"])) for r in mine),
                "consensus_ppl_mean": statistics.fmean(perplexity(r["consensus_val_loss"]) for r in mine),
                "weight_std_mean": statistics.fmean(r["weight_std"] for r in mine),
                "paper_ppl": paper_ppl,
                "paper_gap_pct": 100.0 * (paper_ppl / paper["ddp"] - 1.0) if paper_ppl is not None else None,
            })
    return rows


def scaling_rows(runs: Sequence[dict], reference_grid: tuple[int, int]) -> list[dict]:
    """One row per M: DiLoCo's eval loss over DDP's (the ``reference_grid`` DDP runs),
    in %, paired by seed, next to the scaling-law paper's 35M and 2.4B numbers."""
    ref_dp, ref_pp = reference_grid
    ddp_loss = _by_seed(_select(runs, section="grid", dp=ref_dp, pp=ref_pp, method="ddp"), "val_loss")
    scaling = _select(runs, section="scaling")
    rows = []
    for m in sorted({r["dp"] for r in scaling}):
        mine = _select(scaling, dp=m)
        loss = spread([r["val_loss"] for r in mine])
        excess = paired_gaps_pct(_by_seed(mine, "val_loss"), ddp_loss)
        rows.append({
            "kind": "scaling", "m": m, "outer_lr": mine[0]["outer_lr"],
            "outer_momentum": mine[0]["outer_momentum"],
            "nesterov": mine[0]["nesterov"], "seeds": len(mine),
            "val_loss_mean": loss["mean"], "val_loss_std": loss["std"],
            "ddp_val_loss_mean": statistics.fmean(ddp_loss.values()) if ddp_loss else None,
            "excess_pct": statistics.fmean(excess) if excess else None,
            "excess_min_pct": min(excess) if excess else None,
            "excess_max_pct": max(excess) if excess else None,
            "paper_35m_excess_pct": PAPER_SCALING_EXCESS_PCT["35M"].get(m),
            "paper_2_4b_excess_pct": PAPER_SCALING_EXCESS_PCT["2.4B"].get(m),
        })
    return rows


# -- the shape checks --------------------------------------------------------------
def _row(rows: Sequence[dict], grid: str, method: str) -> dict | None:
    return next((r for r in rows if r["grid"] == grid and r["method"] == method), None)


def _strictly_increasing(values: Sequence[float]) -> bool:
    return all(b > a for a, b in zip(values, values[1:]))


def check_ddp_best(rows: Sequence[dict]) -> dict:
    """In every grid DDP has the lowest mean perplexity; ``every_seed``: and each
    other method's paired gap to DDP is positive for every seed."""
    grids = sorted({r["grid"] for r in rows})
    best = {g: min((r for r in rows if r["grid"] == g), key=lambda r: r["ppl_mean"])["method"] for g in grids}
    others = [r for r in rows if r["method"] != "ddp" and r["gap_min_pct"] is not None]
    return {"holds": all(m == "ddp" for m in best.values()), "best_by_grid": best,
            "every_seed": all(r["gap_min_pct"] > 0 for r in others)}


def check_local_worst(rows: Sequence[dict]) -> dict:
    """In every grid local-only training (no communication) has the highest mean
    perplexity: any averaging at all should beat none."""
    grids = sorted({r["grid"] for r in rows})
    worst = {g: max((r for r in rows if r["grid"] == g),
                    key=lambda r: r["ppl_mean"])["method"] for g in grids}
    return {"holds": bool(worst) and all(m == "local" for m in worst.values()), "worst_by_grid": worst}


def check_noloco_vs_diloco(rows: Sequence[dict], runs: Sequence[dict]) -> dict:
    """NoLoCo's mean perplexity at or below DiLoCo's in every grid; per grid the
    relative difference in % (negative: NoLoCo better) and in how many seeds it holds."""
    by_grid = {}
    for r in rows:
        if r["method"] != "noloco":
            continue
        diloco = _row(rows, r["grid"], "diloco")
        if diloco is None:
            continue
        select = {"section": "grid", "dp": r["dp"], "pp": r["pp"]}
        paired = paired_gaps_pct(_by_seed(_select(runs, method="noloco", **select), "ppl"),
                                 _by_seed(_select(runs, method="diloco", **select), "ppl"))
        by_grid[r["grid"]] = {
            "diff_pct": 100.0 * (r["ppl_mean"] / diloco["ppl_mean"] - 1.0),
            "seeds_holding": sum(d <= 0 for d in paired),
            "seeds": len(paired),
            "paired_min_pct": min(paired, default=None),
            "paired_max_pct": max(paired, default=None),
        }
    return {"holds": bool(by_grid) and all(v["diff_pct"] <= 0 for v in by_grid.values()),
            "every_seed": bool(by_grid) and all(v["seeds_holding"] == v["seeds"] for v in by_grid.values()),
            "by_grid": by_grid}


def check_gaps_grow_with_dp(rows: Sequence[dict]) -> dict:
    """For each pipeline depth with two or more DP sizes, NoLoCo's and DiLoCo's gap to
    DDP rise strictly with DP."""
    series = {}
    for pp in sorted({r["pp"] for r in rows}):
        dps = sorted({r["dp"] for r in rows if r["pp"] == pp})
        if len(dps) < 2:
            continue
        for method in ("noloco", "diloco"):
            gaps = [_row(rows, f"{dp} x {pp}", method) for dp in dps]
            if all(g is not None for g in gaps):
                series[f"{method} PP={pp}"] = {"dp": dps, "gap_pct": [g["gap_to_ddp_pct"] for g in gaps]}
    return {"holds": bool(series) and all(_strictly_increasing(s["gap_pct"]) for s in series.values()),
            "series": series}


def check_scaling_order(rows: Sequence[dict]) -> dict:
    """DiLoCo's excess over DDP rises strictly with M (the scaling-law ordering)."""
    excess = [r["excess_pct"] for r in sorted(rows, key=lambda r: r["m"])]
    return {"holds": len(excess) > 1 and _strictly_increasing(excess), "m": sorted(r["m"] for r in rows),
            "excess_pct": excess}


# -- the sweeps ----------------------------------------------------------------------
def best_by_loss(runs: Iterable[dict], key: str) -> object:
    """The ``key`` of the run with the lowest validation loss (ties: the first listed)."""
    return min(runs, key=lambda r: r["val_loss"])[key]


def scaling_choices(runs: Sequence[dict], seed: int) -> dict[int, float]:
    """Per M, the outer lr whose ``seed`` run ended lowest: the scaling-law paper's
    procedure (sweep, report the best)."""
    first = _select(runs, section="scaling", seed=seed)
    return {m: best_by_loss(_select(first, dp=m), "outer_lr") for m in sorted({r["dp"] for r in first})}


def scaling_sweep_rows(runs: Sequence[dict], seed: int, chosen: dict[int, float]) -> list[dict]:
    """What the outer-lr sweep of the scaling rows saw on ``seed``."""
    return [{"kind": "scaling_sweep", "m": r["dp"], "outer_lr": r["outer_lr"], "val_loss": r["val_loss"],
             "chosen": chosen.get(r["dp"]) == r["outer_lr"]}
            for r in sorted(_select(runs, section="scaling", seed=seed), key=lambda r: (r["dp"],
                                                                                        r["outer_lr"]))]


def with_default_label(runs: Iterable[dict], default: str) -> list[dict]:
    return [r | {"variant": r.get("variant") or default} for r in runs]


def sweep_rows(runs: Sequence[dict], grid: tuple[int, int], seed: int, default: str) -> list[dict]:
    """NoLoCo's settings on one grid: each variant's loss on ``seed`` against the
    defaults' (paired), and over every seed where the variant ran on all of them, its
    mean gap to the defaults and to DiLoCo."""
    dp, pp = grid
    noloco = with_default_label(_select(runs, section="grid", dp=dp, pp=pp, method="noloco"), default)
    noloco += _select(runs, section="sweep", dp=dp, pp=pp)
    diloco = _by_seed(_select(runs, section="grid", dp=dp, pp=pp, method="diloco"), "val_loss")
    defaults = _by_seed([r for r in noloco if r["variant"] == default], "val_loss")
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in noloco):
        mine = [r for r in noloco if r["variant"] == variant]
        losses = _by_seed(mine, "val_loss")
        to_default = paired_gaps_pct(losses, defaults)
        to_diloco = paired_gaps_pct(losses, diloco)
        rows.append({"kind": "sweep", "grid": f"{dp} x {pp}", "variant": variant, "seeds": len(mine),
                     "first_seed_val_loss": losses.get(seed),
                     "val_loss_mean": statistics.fmean(losses.values()),
                     "gap_to_default_pct": statistics.fmean(to_default) if to_default else None,
                     "gap_to_diloco_pct": statistics.fmean(to_diloco) if to_diloco else None,
                     "gap_to_diloco_min_pct": min(to_diloco) if to_diloco else None,
                     "gap_to_diloco_max_pct": max(to_diloco) if to_diloco else None,
                     "weight_std_mean": statistics.fmean(r["weight_std"] for r in mine),
                     "outer_lr": mine[0]["outer_lr"], "outer_momentum": mine[0]["outer_momentum"],
                     "outer_gamma": mine[0]["outer_gamma"], "outer_gain": outer_gain(mine[0])})
    return rows


def outer_gain(run: dict) -> float | None:
    """How many times a steady Delta is applied per round: beta / (1 - alpha) for the
    heavy-ball form both methods use (``None`` for methods without an outer step)."""
    if run.get("outer_lr") is None or run.get("outer_momentum") is None:
        return None
    return run["outer_lr"] / (1.0 - run["outer_momentum"])


def sweep_choice(runs: Sequence[dict], grid: tuple[int, int], seed: int, default: str) -> str:
    """The NoLoCo setting with the lowest loss on ``seed`` (the defaults' label if they won)."""
    dp, pp = grid
    candidates = with_default_label(_select(runs, section="grid", dp=dp, pp=pp, method="noloco", seed=seed),
                                    default)
    return best_by_loss(candidates + _select(runs, section="sweep", dp=dp, pp=pp, seed=seed), "variant")


# -- time to a target loss ---------------------------------------------------------
def steps_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The step at which the loss curve first reaches ``target``, linear between its
    points (the curve starts from its first point: targets are reached later)."""
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def target_loss(runs: Sequence[dict], methods: Sequence[str] = ("noloco", "diloco")) -> float:
    """A loss every one of ``methods`` reaches on every seed: the highest final point of
    their validation-loss curves."""
    return max(r["loss_curve"][-1][1] for r in runs if r["method"] in methods)


def steps_to_target_rows(runs: Sequence[dict], choice: str | None = None) -> list[dict]:
    """Per grid and method: the inner steps until the validation loss reaches the grid's
    target (mean over seeds; None where a seed never reaches it); with ``choice``, the
    NoLoCo sweep's chosen setting too, on the sweep's grid (its runs on every seed),
    against the same target."""
    grid_runs = _select(runs, section="grid")
    chosen = _select(runs, section="sweep", variant=choice) if choice else []
    rows = []
    for dp, pp in sorted({(r["dp"], r["pp"]) for r in grid_runs}, key=lambda g: (g[1], g[0])):
        mine = _select(grid_runs, dp=dp, pp=pp)
        target = target_loss(mine)
        kinds = [(method, "", _select(mine, method=method)) for method in METHOD_ORDER]
        kinds.insert(METHOD_ORDER.index("noloco") + 1, ("noloco", choice, _select(chosen, dp=dp, pp=pp)))
        for method, setting, of_kind in kinds:
            if not of_kind:
                continue
            steps = [steps_to_target(r["loss_curve"], target) for r in of_kind]
            rows.append({"kind": "to_target", "dp": dp, "pp": pp, "grid": f"{dp} x {pp}", "method": method,
                         "setting": setting or "", "target_loss": target,
                         "inner_steps": of_kind[0]["inner_steps"],
                         "steps": None if None in steps else statistics.fmean(steps)})
    return rows


WIRE_BAR_PCT = 1.0  # issue 16: each way of moving a round within 1 % of the blocking 16-bit round


def _noloco_setting(run: dict) -> tuple:
    return run["outer_lr"], run["outer_momentum"], run["outer_gamma"]


def wire_rows(runs: Sequence[dict], baseline: str, order: Sequence[str] = ()) -> list[dict]:
    """The wire section: each variant's final validation loss (random paths) against the
    blocking 16-bit round's at the same NoLoCo setting on the same seeds (paired), with
    the spread over seeds; in ``order`` (the plan's), then any other variant the runs hold.
    ``baseline`` is the label of the blocking round at the defaults; at another setting
    it is the label that starts with it."""
    wire = _select(runs, section="wire")
    references: dict[tuple, dict[int, float]] = {}  # NoLoCo setting -> seed -> the blocking round's loss
    for r in wire:
        if r["variant"] == baseline or r["variant"].startswith(baseline + "; "):
            references.setdefault(_noloco_setting(r), {})[r["seed"]] = r["val_loss"]
    rows = []
    ran = dict.fromkeys(r["variant"] for r in wire)
    for variant in [v for v in order if v in ran] + [v for v in ran if v not in order]:
        mine = _select(wire, variant=variant)
        losses = _by_seed(mine, "val_loss")
        gaps = paired_gaps_pct(losses, references.get(_noloco_setting(mine[0]), {}))
        rows.append({"kind": "wire", "grid": f"{mine[0]['dp']} x {mine[0]['pp']}", "variant": variant,
                     "outer_momentum": mine[0]["outer_momentum"], "seeds": len(mine),
                     "outer_codec": mine[0]["outer_codec"],
                     "activation_codec": mine[0]["activation_codec"],
                     "outer_latency_steps": mine[0]["outer_latency_steps"],
                     "val_loss_mean": statistics.fmean(losses.values()),
                     "val_loss_std": statistics.stdev(losses.values()) if len(losses) > 1 else 0.0,
                     "gap_pct": statistics.fmean(gaps) if gaps else None,
                     "gap_min_pct": min(gaps) if gaps else None, "gap_max_pct": max(gaps) if gaps else None,
                     "within_bar": bool(gaps) and abs(statistics.fmean(gaps)) <= WIRE_BAR_PCT})
    return rows
