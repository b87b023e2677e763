"""The convergence benchmark's arithmetic and rendering, on made-up runs (no training)."""

import math

import pytest

from bench.common.results import Result
from bench.convergence.benchmark import summarise
from bench.convergence.plan import (
    FULL,
    NOLOCO_DEFAULT,
    QUICK,
    WIRE_BASELINE,
    confirming_jobs,
    main_jobs,
    tuning_jobs,
)
from bench.convergence.report import markdown
from bench.convergence.stats import (
    check_ddp_best,
    check_gaps_grow_with_dp,
    check_local_worst,
    check_noloco_vs_diloco,
    check_scaling_order,
    grid_rows,
    paired_gaps_pct,
    scaling_choices,
    scaling_rows,
    spread,
    steps_to_target,
    steps_to_target_rows,
    sweep_choice,
    sweep_rows,
    wire_rows,
)
from bench.convergence.wallclock import Link, RoundHere, allreduce_messages, step_cost, wall_rows


def _run(section, dp, pp, method, seed, loss, outer_lr=None, variant=""):
    curve = [[step, loss + 1.0 / step] for step in (10, 20, 40, 80)]  # falls to about the final loss
    return {"kind": "run", "section": section, "dp": dp, "pp": pp, "method": method, "seed": seed,
            "variant": variant, "inner_lr": 2e-3, "loss_curve": curve, "outer_rounds": 8,
            "val_loss": loss, "ppl": math.exp(loss), "fixed_val_loss": loss, "consensus_val_loss": loss,
            "weight_std": 0.0,
            "outer_lr": 0.7 if outer_lr is None and method in ("noloco", "diloco") else outer_lr,
            "outer_gamma": 0.7, "outer_momentum": 0.3 if method == "diloco" else 0.5,
            "nesterov": section == "scaling",
            "inner_steps": 100 if method == "diloco" else 50, "tokens": 1000, "num_parameters": 10,
            "wall_s": 1.0,
            "cpu_s": 1.0, "val_windows": 256, "all_val_windows": 486}


# Losses shaped like the paper: DDP best, NoLoCo below DiLoCo, gaps growing with DP.
PAPER_LIKE = {(4, 2): {"ddp": 1.00, "noloco": 1.02, "diloco": 1.03, "local": 1.10},
              (8, 2): {"ddp": 1.00, "noloco": 1.04, "diloco": 1.05, "local": 1.20},
              (8, 1): {"ddp": 1.00, "noloco": 1.05, "diloco": 1.06, "local": 1.20}}


def _paper_like_runs():
    runs = [_run("grid", dp, pp, method, seed, loss + 0.001 * seed)
            for (dp, pp), losses in PAPER_LIKE.items() for method, loss in losses.items() for seed in (0, 1)]
    runs += [_run("scaling", m, 1, "diloco", seed, 1.0 + 0.01 * i + 0.001 * seed + abs(lr - 0.2), outer_lr=lr)
             for i, m in enumerate((1, 2, 4, 8)) for seed in (0, 1) for lr in (0.1, 0.2)]
    runs += [_run("sweep", 4, 2, "noloco", 0, 1.025, variant="gamma = 0.0")]
    return runs


CHOSEN = {"inner_lr": None, "scaling_outer_lr": {1: 0.2, 2: 0.2, 4: 0.2, 8: 0.2}, "noloco": NOLOCO_DEFAULT}


def test_spread_and_paired_gaps():
    assert spread([1.0, 3.0]) == {"mean": 2.0, "std": pytest.approx(math.sqrt(2)), "min": 1.0, "max": 3.0}
    assert spread([2.0])["std"] == 0.0
    assert paired_gaps_pct({0: 11.0, 1: 12.0, 2: 5.0}, {0: 10.0, 1: 10.0}) == pytest.approx([10.0, 20.0])


def test_grid_rows_gap_and_paper_numbers():
    rows = grid_rows(_paper_like_runs())
    noloco = next(r for r in rows if r["grid"] == "4 x 2" and r["method"] == "noloco")
    assert noloco["gap_to_ddp_pct"] == pytest.approx(100 * (math.exp(0.02) - 1))
    assert noloco["paper_ppl"] == 31.3 and noloco["paper_gap_pct"] == pytest.approx(100 * (31.3 / 29.1 - 1))
    assert next(r for r in rows if r["method"] == "local")["paper_ppl"] is None
    assert [r["grid"] for r in rows if r["method"] == "ddp"] == ["8 x 1", "4 x 2", "8 x 2"]


def test_checks_pass_on_paper_like_runs():
    runs = _paper_like_runs()
    rows = grid_rows(runs)
    assert check_ddp_best(rows)["holds"] and check_ddp_best(rows)["every_seed"]
    assert check_noloco_vs_diloco(rows, runs)["holds"] and check_local_worst(rows)["holds"]
    grow = check_gaps_grow_with_dp(rows)
    assert grow["holds"] and list(grow["series"]) == ["noloco PP=2", "diloco PP=2"]
    chosen = [r for r in runs if r["section"] != "scaling" or r["outer_lr"] == 0.2]
    scaling = scaling_rows(chosen, (8, 1))
    assert scaling[0]["excess_pct"] == pytest.approx(0.0) and check_scaling_order(scaling)["holds"]


def test_checks_fail_when_the_shape_is_broken():
    runs = [r | {"val_loss": 0.9, "ppl": math.exp(0.9)} if (r["method"], r["dp"]) == ("diloco", 8) else r
            for r in _paper_like_runs()]
    rows = grid_rows(runs)
    assert check_ddp_best(rows)["best_by_grid"]["8 x 2"] == "diloco" and not check_ddp_best(rows)["holds"]
    assert not check_noloco_vs_diloco(rows, runs)["holds"]
    assert not check_gaps_grow_with_dp(rows)["holds"]
    worse = [r | {"val_loss": 9.0, "ppl": math.exp(9.0)} if (r["method"], r["dp"], r["pp"]) == ("noloco", 4,
                                                                                                2) else r
             for r in _paper_like_runs()]
    local = check_local_worst(grid_rows(worse))
    assert not local["holds"] and local["worst_by_grid"]["4 x 2"] == "noloco"


def test_plan_phases_and_markdown_render_from_json_alone():
    tune = tuning_jobs(QUICK)
    assert [j.inner_lr for j in tune] == list(QUICK.inner_lrs) and {j.method for j in tune} == {"ddp"}
    jobs = main_jobs(QUICK, 2e-3)
    grid_jobs = [j for j in jobs if j.section == "grid"]
    assert len(grid_jobs) == len(QUICK.seeds) * 4 * len(QUICK.grids) and jobs[0].cost >= jobs[-1].cost
    scaling_jobs = [j for j in jobs if j.section == "scaling"]
    assert len(scaling_jobs) == len(QUICK.scaling_m) * len(QUICK.scaling_outer_lrs)
    assert all(j.nesterov and j.outer_momentum == 0.9 and j.seed == QUICK.seeds[0] for j in scaling_jobs)
    assert all(j.inner_lr == 2e-3 for j in jobs)
    assert [j.outer_gamma for j in jobs if j.section == "sweep"] == [0.0]
    confirm = confirming_jobs(QUICK, 2e-3, {1: 0.2, 8: 0.1}, "gamma = 0.0")
    assert sorted((j.section, j.dp, j.outer_lr, j.outer_gamma) for j in confirm) == [
        ("scaling", 1, 0.2, None), ("scaling", 8, 0.1, None), ("sweep", 4, None, 0.0)]
    assert [j.seed for j in confirm] == [1, 1, 1]
    assert confirming_jobs(QUICK, None, {}, NOLOCO_DEFAULT) == []  # the grids ran the defaults on every seed

    result = Result("convergence", "quick")
    home = {"payload_s_fp16": 6.0, "volunteer_step_s": 0.12, "rate_mbit": 8.9, "rounds_as_run_here": {
        "noloco": {"volunteers": 4, "round_s": 3.6, "utilisation": 0.96},
        "diloco": {"volunteers": 4, "round_s": 10.8, "utilisation": 0.9}}}
    summarise(result, QUICK, _paper_like_runs(), CHOSEN, home)
    text = markdown({"mode": "quick", "wall_s": 1.0, "machine": {"cpu_count": 2}, "rows": result.rows,
                     "summary": result.summary, "notes": []})
    noloco_ppl = (math.exp(1.02) + math.exp(1.021)) / 2
    assert f"| noloco | {noloco_ppl:.3f} |" in text and "+7.6 %" in text  # the paper's 4 x 2 NoLoCo gap
    assert text.count("**yes**") == 6 and "All checks hold" in text
    assert "Nesterov momentum 0.9" in text and "0.1 -> 1.1" in text and "(best)" in text
    assert "| gamma = 0.0 | 1.40 | 1.0250 | 1 |" in text and "| home | 8 x 1 | noloco | as run here |" in text
    assert "| home | 8 x 1 | diloco | as run here |" in text and "diloco's round 90 inner steps" in text


def test_the_wire_section_at_the_sweeps_choice_pairs_with_the_blocking_round_at_that_choice():
    wire = [j for j in confirming_jobs(FULL, 3e-3, {}, "alpha = 0.3") if j.section == "wire"]
    # every seed: the first ran only the defaults
    assert len(wire) == len(FULL.wire_at_choice) * len(FULL.seeds)
    assert {j.outer_momentum for j in wire} == {0.3} and all(
        j.variant.endswith("; alpha = 0.3") for j in wire
    )
    late = "overlapped, half a round late"

    def run(variant, seed, loss, alpha):
        return _run("wire", 4, 2, "noloco", seed, loss, variant=variant) | {
            "outer_momentum": alpha, "outer_codec": "fp16", "activation_codec": "fp16",
            "outer_latency_steps": 5 if variant.startswith(late) else None}

    runs = [run(WIRE_BASELINE, s, 1.0 + s, 0.5) for s in (0, 1)] + [run(late, s, 1.02 * (1.0 + s),
                                                                        0.5) for s in (0, 1)]
    runs += [run(f"{WIRE_BASELINE}; alpha = 0.3", s, 0.9 + s, 0.3) for s in (0, 1)]
    runs += [run(f"{late}; alpha = 0.3", s, 1.005 * (0.9 + s), 0.3) for s in (0, 1)]
    gaps = {r["variant"]: r["gap_pct"] for r in wire_rows(runs, WIRE_BASELINE)}
    assert gaps[late] == pytest.approx(2.0) and gaps[f"{late}; alpha = 0.3"] == pytest.approx(0.5)
    assert gaps[WIRE_BASELINE] == 0.0 == gaps[f"{WIRE_BASELINE}; alpha = 0.3"]


def test_sweeps_choose_the_lowest_loss_on_the_first_seed():
    runs = _paper_like_runs()
    assert scaling_choices(runs, 0) == {1: 0.2, 2: 0.2, 4: 0.2, 8: 0.2}
    assert sweep_choice(runs, (4, 2), 0, NOLOCO_DEFAULT) == NOLOCO_DEFAULT  # 1.02 beats gamma = 0's 1.025
    better = runs + [_run("sweep", 4, 2, "noloco", 0, 1.01, variant="beta = 1.0")]
    assert sweep_choice(better, (4, 2), 0, NOLOCO_DEFAULT) == "beta = 1.0"
    rows = {r["variant"]: r for r in sweep_rows(better, (4, 2), 0, NOLOCO_DEFAULT)}
    assert rows[NOLOCO_DEFAULT]["seeds"] == 2 and rows["beta = 1.0"]["seeds"] == 1
    assert rows["beta = 1.0"]["gap_to_default_pct"] == pytest.approx(100 * (1.01 / 1.02 - 1))
    assert rows[NOLOCO_DEFAULT]["gap_to_diloco_pct"] < 0


def test_steps_to_target_and_the_wall_clock_model():
    curve = [[25, 3.0], [50, 2.5], [75, 2.4]]
    assert steps_to_target(curve, 2.5) == 50 and steps_to_target(curve, 2.0) is None
    assert steps_to_target(curve, 2.45) == pytest.approx(62.5) and steps_to_target(curve, 3.5) == 25
    to_target = steps_to_target_rows(_paper_like_runs())
    row = {(r["grid"], r["method"]): r for r in to_target}
    # the target is the highest final point of NoLoCo and DiLoCo: both reach it, DDP sooner
    assert row["4 x 2", "diloco"]["target_loss"] == pytest.approx(1.031 + 1 / 80)
    assert row["4 x 2", "ddp"]["steps"] <= row["4 x 2", "noloco"]["steps"] <= row["4 x 2", "diloco"]["steps"]
    assert all(r["setting"] == "" for r in to_target)
    # the sweep's choice, on the sweep's grid only, against the grid's own target
    chosen = [r for r in steps_to_target_rows(_paper_like_runs(), "gamma = 0.0") if r["setting"]]
    assert [(r["grid"], r["method"], r["setting"]) for r in chosen] == [("4 x 2", "noloco", "gamma = 0.0")]
    assert chosen[0]["target_loss"] == row["4 x 2", "diloco"]["target_loss"]
    assert row["4 x 2", "noloco"]["steps"] < chosen[0]["steps"] < row["4 x 2", "diloco"]["steps"]

    assert allreduce_messages(1, 0.5) == 0.0
    # with equal message times a tree all-reduce is 2 log2(N) messages (the paper's model)
    assert allreduce_messages(8, 0.0) == pytest.approx(6.0)
    link = Link(payload_steps=100.0, cv=0.0, here=(("noloco", RoundHere(30.0, 0.95, peers=4)),
                                                    ("diloco", RoundHere(60.0, 0.9, peers=4))))
    assert step_cost("ddp", 8, 10, link) == pytest.approx(601.0)
    assert step_cost("diloco", 8, 10, link) == pytest.approx(61.0)
    assert step_cost("noloco", 8, 10, link) == pytest.approx(41.0)  # phi and Delta, 2 messages each way
    assert step_cost("noloco", 8, 10, link, as_run_here=True) == pytest.approx(3.0)  # waits for the exchange
    # hidden behind compute
    assert step_cost("noloco", 8, 100, link, as_run_here=True) == pytest.approx(1 / 0.95)
    # DiLoCo's round gathers every other peer's payload: measured among 4, 7 others at DP 8
    assert step_cost("diloco", 4, 10, link, as_run_here=True) == pytest.approx(6.0)
    assert step_cost("diloco", 8, 10, link, as_run_here=True) == pytest.approx(60.0 * 7 / 3 / 10)
    assert step_cost("diloco", 4, 1000, link, as_run_here=True) == pytest.approx(1 / 0.9)
    walls = wall_rows([{"grid": "8 x 1", "dp": 8, "method": m, "inner_steps": 10, "steps": 100.0}
                       for m in ("diloco", "noloco", "local")], link)
    assert [(w["method"], w["round"], w["vs_diloco"]) for w in walls] == [
        ("diloco", "paper", 1.0), ("diloco", "as run here", 1.0), ("noloco", "paper", pytest.approx(41 / 61)),
        ("noloco", "as run here", pytest.approx(3 / 14)), ("local", "", pytest.approx(1 / 61))]
    unmeasured = wall_rows([{"grid": "8 x 1", "dp": 8, "method": "noloco", "inner_steps": 10,
                             "steps": 100.0}],
                           Link(payload_steps=100.0, cv=0.0))
    assert [w["round"] for w in unmeasured] == ["paper"]  # no "as run here" without a measured round


def test_where_noloco_trails_is_said_per_grid_with_its_seeds():
    from bench.convergence.report import _where_noloco_behind

    check = {"by_grid": {"8 x 1": {"diff_pct": -2.2, "seeds_holding": 3, "seeds": 3},
                         "4 x 2": {"diff_pct": 0.9, "seeds_holding": 1, "seeds": 3},
                         "8 x 2": {"diff_pct": 5.5, "seeds_holding": 0, "seeds": 3}}}
    assert _where_noloco_behind(check) == (
        "NoLoCo trails DiLoCo in 4 x 2 (+0.90 %, in 2 of 3 seeds only, within the spread between seeds); "
        "8 x 2 (+5.50 %, in every seed) and is ahead in 8 x 1.")


def test_the_overlap_benchmark_runs_every_landing_and_lateness_against_the_blocking_round_on_the_same_seeds():
    from bench.convergence.overlap_starts import BASELINE, jobs

    planned = jobs([0, 1], ["local"], 3e-3, "alpha = 0.3", landings=("whole", "delta-first"),
                   lates=("half", "one", "two"))
    h = FULL.h_of("noloco")
    blocking = [j for j in planned if j.outer_latency_steps is None]
    assert [j.seed for j in blocking] == [0, 1] and all(BASELINE in j.variant for j in blocking)
    overlapped = [j for j in planned if j.outer_latency_steps is not None]
    assert sorted({(j.outer_latency_steps, j.outer_landing) for j in overlapped}) == [
        (h // 2, "delta-first"), (h // 2, "whole"), (h, "delta-first"), (h, "whole"), (2 * h, "delta-first"),
        (2 * h, "whole")]
    assert len({j.variant for j in overlapped}) == 6 and all(j.outer_momentum == 0.3 for j in planned)
    assert all(j.outer_codec == j.activation_codec == "fp16" for j in planned)
