"""Benchmark 4, convergence: NoLoCo vs DiLoCo vs DDP vs local-only training at equal
tokens on the bundled real-text corpus, in the paper's DP x PP grids, over several
seeds; the DiLoCo scaling-law ordering (eval loss over DDP's) at M = 1, 2, 4, 8; a sweep
of NoLoCo's open settings; and the wall time to a target loss on a home link.

    .venv/bin/python -m bench.convergence [--full] [--workers N]

Every run is the project's in-process simulator (swarm_node.sim) with the real inner
and outer optimizers and random routing between stages. The global batch is fixed and
split over the DP replicas (as in the paper, whose FSDP baseline is one number for all
grids), so every method and grid sees the same tokens per step and in total. Phases and
jobs: bench/convergence/plan.py; one run: runs.py; arithmetic: stats.py and
wallclock.py; plots and BENCHMARKS.md: report.py."""

from __future__ import annotations

import json
import os
import sys
import time

from bench.common.results import Result, load, parse_mode, pyplot
from bench.convergence.plan import (
    FULL,
    NOLOCO_DEFAULT,
    QUICK,
    WIRE_BASELINE,
    Plan,
    confirming_jobs,
    main_jobs,
    tuning_jobs,
    wire_jobs,
    wire_label,
)
from bench.convergence.report import markdown, plot  # noqa: F401  (bench.report renders through markdown)
from bench.convergence.runs import Runner
from bench.convergence.stats import (
    best_by_loss,
    check_ddp_best,
    check_gaps_grow_with_dp,
    check_local_worst,
    check_noloco_vs_diloco,
    check_scaling_order,
    grid_rows,
    scaling_choices,
    scaling_rows,
    scaling_sweep_rows,
    steps_to_target_rows,
    sweep_choice,
    sweep_rows,
    wire_rows,
)
from bench.convergence.wallclock import Link, link_from_home_link, wall_rows
from swarm_node.optim.methods import default_method

NAME = "convergence"
FAST_LINK = Link(payload_steps=1.0)  # a 16-bit payload in one inner step: a datacenter-like link


def run_plan(plan: Plan, workers: int) -> tuple[list[dict], dict]:
    """Every phase; returns the runs and what was chosen along the way."""
    with Runner(workers) as runner:
        tuned = runner.run(tuning_jobs(plan), "tune")
        inner_lr = best_by_loss(tuned, "inner_lr") if tuned else None
        runs = tuned + runner.run(main_jobs(plan, inner_lr), "main")
        first = plan.seeds[0]
        chosen = {"inner_lr": inner_lr, "scaling_outer_lr": scaling_choices(runs, first),
                  "noloco": sweep_choice(runs, plan.sweep_grid, first, NOLOCO_DEFAULT)}
        runs += runner.run(confirming_jobs(plan, inner_lr, chosen["scaling_outer_lr"], chosen["noloco"]),
                           "confirm")
    return runs, chosen


def _chosen_scaling_runs(runs: list[dict], chosen: dict[int, float]) -> list[dict]:
    return [r for r in runs if r["section"] != "scaling" or chosen.get(r["dp"]) == r["outer_lr"]]


def summarise(result: Result, plan: Plan, runs: list[dict], chosen: dict, home_link: dict | None) -> None:
    first = plan.seeds[0]
    grids = grid_rows(runs)
    scaling = scaling_rows(_chosen_scaling_runs(runs, chosen["scaling_outer_lr"]), plan.scaling_reference)
    to_target = steps_to_target_rows(runs, None if chosen["noloco"] == NOLOCO_DEFAULT else chosen["noloco"])
    home = link_from_home_link(home_link) if home_link else None
    walls = [r | {"link": "fast"} for r in wall_rows(to_target, FAST_LINK)]
    if home is not None:
        walls += [r | {"link": "home"} for r in wall_rows(to_target, home)]
    wire = wire_rows(runs, WIRE_BASELINE, [v.label for v in plan.wire_variants]
                     + [wire_label(v.label, chosen["noloco"]) for v in plan.wire_at_choice])
    result.rows = (grids + scaling + scaling_sweep_rows(runs, first, chosen["scaling_outer_lr"])
                   + sweep_rows(runs, plan.sweep_grid, first,
                                NOLOCO_DEFAULT) + wire + to_target + walls + runs)
    checks = {"ddp_best": check_ddp_best(grids), "local_worst": check_local_worst(grids),
              "noloco_le_diloco": check_noloco_vs_diloco(grids, runs),
              "gaps_grow_with_dp": check_gaps_grow_with_dp(grids),
              "scaling_order": check_scaling_order(scaling)}
    grid_run = next(r for r in runs if r["section"] == "grid")
    result.summary = {
        "model": plan.model, "num_parameters": grid_run["num_parameters"], "steps": plan.steps,
        "global_batch": plan.global_batch, "seq_len": plan.seq_len, "tokens_per_run": grid_run["tokens"],
        "seeds": list(plan.seeds), "scaling_reference": "{} x {}".format(*plan.scaling_reference),
        "inner_lr": grid_run["inner_lr"], "inner_lr_candidates": list(plan.inner_lrs),
        "scaling_outer_lr": {str(m): lr for m, lr in chosen["scaling_outer_lr"].items()},
        "scaling_momentum": plan.scaling_momentum, "noloco_choice": chosen["noloco"],
        "sweep_grid": "{} x {}".format(*plan.sweep_grid),
        "checks": checks, "paper_shape_reproduced": all(c["holds"] for c in checks.values()),
        "val_windows": grid_run["val_windows"], "all_val_windows": grid_run["all_val_windows"],
        "run_cpu_s_total": sum(r["cpu_s"] for r in runs), "runs": len(runs),
        "inner_steps": {m: plan.h_of(m) or default_method(m).inner_steps for m in ("noloco", "diloco")},
        # issue 16's bar, beside the paper's shape (not part of it)
        "wire_within_1pct": None if not wire else {
            "holds": all(r["within_bar"] for r in wire), "gaps_pct": {r["variant"]: round(r["gap_pct"],
                                                                                          3) for r in wire}},
        "home_link": None if home is None else {
            "payload_steps": round(home.payload_steps, 1), "rate_mbit": home_link.get("rate_mbit"),
            "rounds_as_run_here": {m: {"round_steps": round(r.round_steps, 1), "utilisation": r.utilisation,
                                       "peers": r.peers} for m, r in home.here}},
    }


def _options(parser) -> None:
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="parallel simulator processes (default: CPUs)")
    parser.add_argument(
        "--wire-only",
        action="store_true",
        help="run only the wire section (the overlapped round and the codecs) with the last result's "
        "inner lr, and put its runs into that result in place of any earlier ones",
    )
    parser.add_argument(
        "--wire-at-choice",
        action="store_true",
        help="as --wire-only, but only the wire variants at the NoLoCo setting the last result's "
        "sweep chose (when it is not the defaults)",
    )
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="train nothing: recompute the tables from the runs in the last result of this mode "
        "(after a new home_link result, for the time-to-target table)",
    )


def _resummarise(plan: Plan, result: Result, workers: int | None = None,
                 at_choice_only: bool = False) -> None:
    """The last result of this mode with its tables recomputed from its runs; when and
    how it ran stay as they were. With ``workers``, the wire section's runs are made
    first (on that result's inner lr and NoLoCo choice; ``at_choice_only``: only those at
    the choice) and replace the runs of the same variants."""
    last = load(NAME, result.out_dir)
    if last is None or last["mode"] != result.mode:
        raise SystemExit(f"bench.{NAME}: no {result.mode} result in {result.out_dir} to resummarise")
    s = last["summary"]
    chosen = {"inner_lr": s["inner_lr"], "noloco": s["noloco_choice"],
              "scaling_outer_lr": {int(m): lr for m, lr in s["scaling_outer_lr"].items()}}
    runs = [r for r in last["rows"] if r["kind"] == "run"]
    if workers is not None:
        started = time.perf_counter()
        jobs = [] if at_choice_only else wire_jobs(plan, s["inner_lr"])
        if chosen["noloco"] != NOLOCO_DEFAULT:
            jobs += wire_jobs(plan, s["inner_lr"], chosen["noloco"])
        with Runner(workers) as runner:
            wire = runner.run(jobs, "wire")
        redone = {r["variant"] for r in wire}
        runs = [r for r in runs if r["section"] != "wire" or r["variant"] not in redone] + wire
        section, flag = (("The wire section at the NoLoCo choice", "--wire-at-choice") if at_choice_only
                         else ("The wire section", "--wire-only"))
        last["notes"] = [n for n in last["notes"] if not n.startswith(section)] + [
            f"{section} ({len(wire)} runs) was run on its own afterwards (`{flag}`): "
            f"{time.perf_counter() - started:.0f} s wall, {sum(r['cpu_s'] for r in wire):.0f} CPU-seconds."]
    home_link = load("home_link")
    summarise(result, plan, runs, chosen, home_link["summary"] if home_link else None)
    last |= {"rows": result.rows, "summary": result.summary,
             "notes": [n for n in last["notes"] if not n.startswith("No bench/results/home_link.json")]}
    result.path().write_text(json.dumps(last, indent=1) + "\n")
    plot(result.rows, result.path(".png"), pyplot())


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=_options)
    plan = FULL if args.full else QUICK
    result = Result(NAME, args.mode, args.out_dir)
    started = time.perf_counter()
    if args.resummarise or args.wire_only or args.wire_at_choice:
        _resummarise(plan, result, max(1, args.workers) if args.wire_only or args.wire_at_choice else None,
                     at_choice_only=args.wire_at_choice)
        return 0
    runs, chosen = run_plan(plan, max(1, args.workers))
    home_link = load("home_link")
    summarise(result, plan, runs, chosen, home_link["summary"] if home_link else None)
    cpu_s = result.summary["run_cpu_s_total"]
    result.note(
        f"{len(runs)} simulator runs on {args.workers} processes of one torch thread each: "
        f"{time.perf_counter() - started:.0f} s wall, {cpu_s:.0f} CPU-seconds inside the runs, so about "
        f"{cpu_s / args.workers:.0f} s on {args.workers} otherwise idle cores; the wall time grows with "
        "whatever else the machine runs, the CPU time much less."
    )
    if home_link is None:
        result.note("No bench/results/home_link.json: the wall-clock table has the fast link only; "
                    "run python -m bench.home_link first for the home link.")
    plot(result.rows, result.path(".png"), pyplot())
    result.write()
    print(f"bench.{NAME}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0
