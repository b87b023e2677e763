"""Benchmark 2, latency model at scale: the NoLoCo paper's section 5.3 model re-simulated
for N = 2 ... 1024 peers, checked against the paper's numbers, then fed with the message
and inner-step times measured by bench.sync_cost and bench.swarm_efficiency.

    .venv/bin/python -m bench.latency_model [--full]

Pure numpy Monte Carlo (bench/common/latency.py), no network. Part 1: critical path
of a binary-tree all-reduce among N peers against one pair exchange, log-normal message
times with std/t in {0, 0.5, 1, 1.5, 2.5}. Part 2: wall time of a run under DiLoCo's
global barrier against NoLoCo's pairwise waits, inner-step times LogNormal(1, 0.5).
Part 3: the same models fed with the message times of bench/results/sync_cost.json and
the inner-step times of bench/results/swarm_efficiency.json where those exist (formats:
bench/latency_model/inputs.py); without them the section says which inputs were missing
and that the paper's defaults stand alone. Plots and BENCHMARKS.md section:
bench/latency_model/report.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bench.common.latency import (
    Variant,
    allreduce_to_pair_ratio,
    barrier_run_times,
    binomial_tree_paths,
    level_barrier_paths,
    lognormal_params,
    pair_exchange_mean,
    sample_paths,
    slowest_pair_paths,
)
from bench.common.results import Result, load, run_mode
from bench.latency_model.inputs import label, largest_per_setting, small_n_ratios, source_note, summary_times
from bench.latency_model.report import markdown, plot

__all__ = ["main", "markdown", "run"]

NAME = "latency_model"
SEED = 5_3  # paper section 5.3
PEER_COUNTS = tuple(2 ** k for k in range(1, 11))  # 2 ... 1024
MESSAGE_CVS = (0.0, 0.5, 1.0, 1.5, 2.5)  # std / mean of the message time
PAPER_ALLREDUCE_RATIO = {0.0: 10.0, 0.5: 12.0, 1.0: 17.0, 1.5: 24.0, 2.5: 40.0}  # at N = 1024
STEP_MU, STEP_SIGMA2 = 1.0, 0.5  # the paper's inner-step times, LogNormal(mu, sigma^2)
INNER_STEP_COUNTS = (50, 100)  # H
PAPER_BARRIER_RATIO = {(1024, 100): 1.19, (1024, 50): 1.28, (16, 100): 1.07}  # (N, H): DiLoCo / NoLoCo
RUN_INNER_STEPS = 25_000  # the paper's run length: 250 outer rounds at H = 100, start-up transient negligible
COMBINED_CONFIGS = ((16, 100), (1024, 100))  # (N, H) of the whole-round projection with measured times
ALLREDUCE_QUANTITY, BARRIER_QUANTITY = "all-reduce / pair critical path", "DiLoCo / NoLoCo run time"

# tree: samples per (N, std/t); variants: samples for the interpretation check at N = 1024;
# workers: simulated workers per barrier point (N < workers: several independent swarms).
BUDGETS = {"quick": {"tree": 2000, "variants": 400, "workers": 256},
           "full": {"tree": 20000, "variants": 4000, "workers": 4096}}

# How "all-reduce / pair" could be read; the first is the one reported (it matches the paper).
INTERPRETATIONS = {
    "tree; pair = E[one pair exchange]": "used: each merge waits for its two messages; the pair is N = 2",
    "tree; pair = 2 t": "the same tree against two back-to-back message times",
    "tree; pair = slowest of N/2 pairs": "as if a pair round had a global barrier",
    "binomial tree; pair = 2 t": "a peer is its own child: one message per merge",
    "barrier per tree level; pair = E[one pair exchange]":
        "each level waits for its slowest message anywhere",
}


def rel_diff(simulated: float, paper: float) -> float:
    return (simulated - paper) / paper


def rng_for(part: int) -> np.random.Generator:
    """An independent stream per part, so changing one part's sample count leaves the others alone."""
    return np.random.default_rng([SEED, part])


# ---- part 1: all-reduce vs pair ----

def allreduce_curve(cvs, samples: int, part: int) -> list[dict]:
    """All-reduce / pair ratio for every N and std/t; times in units of the mean message time t."""
    rng = rng_for(part)
    rows = []
    for cv in cvs:
        for n in PEER_COUNTS:
            r = allreduce_to_pair_ratio(rng, n, cv, samples)
            rows.append({"n_peers": n, "cv": cv, "ratio": r["ratio"], "stderr": r["stderr"],
                         "allreduce_t": r["allreduce_t"], "pair_t": r["pair_t"]})
    return rows


def interpretation_rows(curve: list[dict], samples: int) -> list[dict]:
    """The ratio at N = 1024 under each reading of the model, against the paper."""
    rng, n = rng_for(2), PEER_COUNTS[-1]
    rows = []
    for cv, paper in PAPER_ALLREDUCE_RATIO.items():
        tree = next(r for r in curve if r["cv"] == cv and r["n_peers"] == n)["allreduce_t"]
        pair = pair_exchange_mean(cv)
        def mean_path(sampler, cv=cv) -> float:
            return float(sample_paths(sampler, rng, n, cv, samples).mean(dtype=np.float64))

        # in the order of INTERPRETATIONS
        ratios = [tree / pair, tree / 2.0, tree / mean_path(slowest_pair_paths),
                  mean_path(binomial_tree_paths) / 2.0, mean_path(level_barrier_paths) / pair]
        rows += [{"table": "interpretation", "interpretation": name, "how": how, "cv": cv,
                  "ratio_at_1024": float(ratio), "paper": paper, "rel_diff": rel_diff(float(ratio), paper)}
                 for (name, how), ratio in zip(INTERPRETATIONS.items(), ratios)]
    return rows


# ---- part 2: global barrier vs pairwise waits ----

def barrier_rows(step_mu: float, step_sigma: float, workers: int, part: int,
                 variants_by_n: dict[int, list[Variant]]) -> list[dict]:
    """DiLoCo / NoLoCo run times for every variant at every N; a variant's ``message`` is kept in its row."""
    rng = rng_for(part)
    rows = []
    for n, variants in variants_by_n.items():
        results = barrier_run_times(rng, n, variants, step_mu, step_sigma, RUN_INNER_STEPS,
                                    max(1, workers // n))
        rows += [{"n_workers": n, "inner_steps": v.inner_steps, "message": v.message, "rounds": r["rounds"],
                  "diloco_round_s": r["diloco_s"] / r["rounds"],
                  "noloco_round_s": r["noloco_s"] / r["rounds"], "ratio": r["ratio"],
                  "idle_fraction": 1 - 1 / r["ratio"]} for v, r in zip(variants, results)]
    return rows


def paper_barrier_rows(workers: int) -> list[dict]:
    variants = [Variant(h) for h in INNER_STEP_COUNTS]
    rows = barrier_rows(STEP_MU, math.sqrt(STEP_SIGMA2), workers, 3, {n: variants for n in PEER_COUNTS})
    return [{k: v for k, v in r.items() if k != "message"} for r in rows]


# ---- part 3: measured inputs ----

def measured_message_rows(messages: dict, curve: list[dict], samples: int) -> list[dict]:
    """Seconds of a pair exchange and of an all-reduce among 1024 at each measured message time.

    The ratio depends on the spread only (std/t), not on t: with a measured spread it is
    simulated; without one (sync_cost stores medians) each of the paper's std/t values is shown."""
    n, rows = PEER_COUNTS[-1], []
    for path, (mean_s, std_s) in messages.items():
        if std_s is None:
            cases = [(r["cv"], "assumed", r["ratio"]) for r in curve if r["n_peers"] == n]
        else:
            cv = std_s / mean_s
            cases = [(cv, "measured", allreduce_to_pair_ratio(rng_for(4), n, cv, samples)["ratio"])]
        for cv, cv_source, ratio in cases:
            pair_s = pair_exchange_mean(cv, mean_s)
            rows.append({"table": "measured_messages", "label": label(path), "mean_s": mean_s, "cv": cv,
                         "cv_source": cv_source, "n_peers": n, "ratio": ratio, "pair_s": pair_s,
                         "allreduce_s": ratio * pair_s})
    return rows


def measured_small_n_rows(sync_cost: dict | None, curve: list[dict]) -> list[dict]:
    """sync_cost's measured all-reduce / pair at N = 2, 4, 8 next to the model with equal message times."""
    model = {r["n_peers"]: r["ratio"] for r in curve if r["cv"] == 0}
    return [{"table": "measured_small_n", **r, "model_equal_times": model[r["n_peers"]]}
            for r in small_n_ratios(sync_cost) if r["n_peers"] in model]


def measured_step_rows(steps: dict, messages: dict, workers: int) -> list[dict]:
    """DiLoCo / NoLoCo at the measured step spread; with measured message times too, whole outer rounds
    (DiLoCo: barrier + tree all-reduce; NoLoCo: pairwise wait + pair exchange), one per network setting."""
    message_labels = {}
    for path, (msg_mean, msg_std) in largest_per_setting(messages).items():
        # unknown spread: equal times, kindest to DiLoCo
        msg_cv = 0.0 if msg_std is None else msg_std / msg_mean
        message_labels[(msg_mean, msg_cv)] = label(path)
    variants_by_n: dict[int, list[Variant]] = {}
    for n, h in PAPER_BARRIER_RATIO:
        variants_by_n.setdefault(n, []).append(Variant(h))
    for n, h in COMBINED_CONFIGS:
        variants_by_n.setdefault(n, []).extend(Variant(h, message) for message in message_labels)
    rows = []
    for step_label, (mean_s, std_s) in steps.items():
        mu, sigma = lognormal_params(mean_s, std_s / mean_s)
        for row in barrier_rows(mu, sigma, workers, 5, variants_by_n):
            message = row.pop("message")
            rows.append({"table": "measured_steps", "step_label": step_label, "step_mean_s": mean_s,
                         "step_cv": std_s / mean_s, "message_label": message_labels.get(message, ""),
                         "message_mean_s": message and message[0], "message_cv": message and message[1],
                         **row})
    return rows


def read_step_times(swarm: dict | None) -> dict[str, tuple[float, float]]:
    """{label: (mean_s, std_s)} of swarm_efficiency's inner-step times; the barrier needs the spread."""
    layout = ((swarm or {}).get("summary", {}).get("step_time_s") or {}).get("layout")
    return {label(path, f"{layout} swarm" if layout else "all"): stats
            for path, stats in summary_times(swarm, "step_time_s").items() if stats[1] is not None}


def add_measured(result: Result, curve: list[dict], budget: dict) -> None:
    sync_cost, swarm = load("sync_cost", result.out_dir), load("swarm_efficiency", result.out_dir)
    messages = summary_times(sync_cost, "message_time_s")
    steps = read_step_times(swarm)
    result.rows += measured_message_rows(messages, curve, budget["tree"])
    result.rows += measured_small_n_rows(sync_cost, curve)
    result.rows += measured_step_rows(steps, messages, budget["workers"])
    result.summary["input_sources"] = {
        "message_time_s": source_note("sync_cost", "message_time_s", sync_cost, bool(messages),
                                      "the paper's std/t values"),
        "step_time_s": source_note("swarm_efficiency", "step_time_s (with a spread)", swarm, bool(steps),
                                   "the paper's LogNormal(1, 0.5) step times")}
    if messages and all(std is None for _, std in messages.values()):
        result.note(
            "sync_cost.json gives one median per setting and size, no spread: the median stands in for "
            "the mean message time t, the all-reduce projections use each of the paper's std/t values, and "
            "the whole-round projection equal message times (the case kindest to DiLoCo)."
        )
    check = [r for r in result.rows if r["table"] == "measured_steps"]
    result.summary["measured_barrier_ratio"] = {f"N = {r['n_workers']}, H = {r['inner_steps']}": r["ratio"]
                                                for r in check if not r["message_label"]}
    result.summary["measured_round_ratio"] = {
        f"{r['message_label']}, N = {r['n_workers']}, H = {r['inner_steps']}": r["ratio"]
        for r in check
        if r["message_label"]
    }


# ---- the run ----

def paper_check_rows(curve: list[dict], barrier: list[dict]) -> list[dict]:
    rows = []
    for cv, paper in PAPER_ALLREDUCE_RATIO.items():
        r = next(r for r in curve if r["cv"] == cv and r["n_peers"] == PEER_COUNTS[-1])
        rows.append({"table": "paper_check", "quantity": ALLREDUCE_QUANTITY, "n": r["n_peers"], "cv": cv,
                     "h": None,
                     "setting": f"N = {r['n_peers']}, std/t = {cv:g}", "simulated": r["ratio"],
                     "paper": paper,
                     "rel_diff": rel_diff(r["ratio"], paper), "stderr": r["stderr"], "paper_rounding": 0.5})
    for (n, h), paper in PAPER_BARRIER_RATIO.items():
        r = next(r for r in barrier if r["n_workers"] == n and r["inner_steps"] == h)
        rows.append({"table": "paper_check", "quantity": BARRIER_QUANTITY, "n": n, "cv": None, "h": h,
                     "setting": f"N = {n}, H = {h}", "simulated": r["ratio"], "paper": paper,
                     "rel_diff": rel_diff(r["ratio"], paper), "stderr": None, "paper_rounding": 0.005})
    return rows


def summarise(result: Result) -> None:
    check = [r for r in result.rows if r["table"] == "paper_check"]
    interp = [r for r in result.rows if r["table"] == "interpretation" and r["cv"] > 0]
    result.summary.update(
        {
            "allreduce_ratio_at_1024": {
                r["setting"]: r["simulated"] for r in check if r["quantity"] == ALLREDUCE_QUANTITY
            },
            "barrier_ratio": {
                r["setting"]: r["simulated"] for r in check if r["quantity"] == BARRIER_QUANTITY
            },
            "max_abs_rel_diff_vs_paper": max(abs(r["rel_diff"]) for r in check),
            "interpretation_used": next(iter(INTERPRETATIONS)),
            "interpretation_mean_abs_rel_diff": {
                name: float(np.mean([abs(r["rel_diff"]) for r in interp if r["interpretation"] == name]))
                for name in INTERPRETATIONS
            },
        }
    )


def run(mode: str, out_dir: Path) -> Result:
    budget = BUDGETS[mode]
    result = Result(NAME, mode, out_dir)
    curve = allreduce_curve(MESSAGE_CVS, budget["tree"], part=1)
    barrier = paper_barrier_rows(budget["workers"])
    result.rows += paper_check_rows(curve, barrier)
    result.rows += [{"table": "allreduce_curve", **r} for r in curve]
    result.rows += interpretation_rows(curve, budget["variants"])
    result.rows += [{"table": "barrier_curve", **r} for r in barrier]
    summarise(result)
    result.summary.update(run_inner_steps=RUN_INNER_STEPS,
                          step_lognormal={"mu": STEP_MU, "sigma2": STEP_SIGMA2})
    add_measured(result, curve, budget)
    return result


def main(argv: list[str] | None = None) -> None:
    run_mode(__doc__.split("\n\n")[0], run, plot, argv)
