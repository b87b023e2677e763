"""The convergence benchmark's arithmetic and rendering, on made-up runs (no training)."""

import math

import pytest

from bench.common.results import Result
from bench.convergence.benchmark import QUICK, jobs_for, markdown, summarise
from bench.convergence.stats import (
    check_ddp_best,
    check_gaps_grow_with_dp,
    check_noloco_vs_diloco,
    check_scaling_order,
    grid_rows,
    paired_gaps_pct,
    scaling_rows,
    spread,
)


def _run(section, dp, pp, method, seed, loss, outer_lr=None):
    return {"kind": "run", "section": section, "dp": dp, "pp": pp, "method": method, "seed": seed,
            "val_loss": loss, "ppl": math.exp(loss), "consensus_val_loss": loss, "weight_std": 0.0,
            "outer_lr": outer_lr, "outer_gamma": 0.7, "outer_momentum": 0.3 if method == "diloco" else 0.5,
            "nesterov": section == "scaling",
            "inner_steps": 100 if method == "diloco" else 50, "tokens": 1000, "num_parameters": 10, "wall_s": 1.0,
            "cpu_s": 1.0, "val_windows": 256, "all_val_windows": 486}


# Losses shaped like the paper: DDP best, NoLoCo below DiLoCo, gaps growing with DP.
PAPER_LIKE = {(4, 2): {"ddp": 1.00, "noloco": 1.02, "diloco": 1.03, "local": 1.10},
              (8, 2): {"ddp": 1.00, "noloco": 1.04, "diloco": 1.05, "local": 1.20},
              (8, 1): {"ddp": 1.00, "noloco": 1.05, "diloco": 1.06, "local": 1.20}}


def _paper_like_runs():
    runs = [_run("grid", dp, pp, method, seed, loss + 0.001 * seed)
            for (dp, pp), losses in PAPER_LIKE.items() for method, loss in losses.items() for seed in (0, 1)]
    runs += [_run("scaling", m, 1, "diloco", seed, 1.0 + 0.01 * i + 0.001 * seed, outer_lr=0.6)
             for i, m in enumerate((1, 2, 4, 8)) for seed in (0, 1)]
    return runs


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
    assert check_noloco_vs_diloco(rows, runs)["holds"]
    grow = check_gaps_grow_with_dp(rows)
    assert grow["holds"] and list(grow["series"]) == ["noloco PP=2", "diloco PP=2"]
    scaling = scaling_rows(runs, (8, 1))
    assert scaling[0]["excess_pct"] == pytest.approx(0.0) and check_scaling_order(scaling)["holds"]


def test_checks_fail_when_the_shape_is_broken():
    runs = [r | {"val_loss": 0.9, "ppl": math.exp(0.9)} if (r["method"], r["dp"]) == ("diloco", 8) else r
            for r in _paper_like_runs()]
    rows = grid_rows(runs)
    assert check_ddp_best(rows)["best_by_grid"]["8 x 2"] == "diloco" and not check_ddp_best(rows)["holds"]
    assert not check_noloco_vs_diloco(rows, runs)["holds"]
    assert not check_gaps_grow_with_dp(rows)["holds"]


def test_plan_and_markdown_render_from_json_alone():
    jobs = jobs_for(QUICK)
    assert len(jobs) == len(QUICK.seeds) * (4 * len(QUICK.grids) + len(QUICK.scaling_m))
    assert jobs[0].cost >= jobs[-1].cost
    result = Result("convergence", "quick")
    summarise(result, QUICK, _paper_like_runs())
    text = markdown({"mode": "quick", "wall_s": 1.0, "machine": {"cpu_count": 2}, "rows": result.rows,
                     "summary": result.summary, "notes": []})
    noloco_ppl = (math.exp(1.02) + math.exp(1.021)) / 2
    assert f"| noloco | {noloco_ppl:.3f} |" in text and "+7.6 %" in text  # the paper's 4 x 2 NoLoCo gap
    assert text.count("**yes**") == 5 and "All four checks hold" in text
    assert "NoLoCo H = 50," in text and "DiLoCo H = 100," in text and "Nesterov momentum" in text
    scaling_jobs = [j for j in jobs if j.section == "scaling"]
    assert all(j.nesterov and j.outer_momentum == 0.9 for j in scaling_jobs)


def test_where_noloco_trails_is_said_per_grid_with_its_seeds():
    from bench.convergence.benchmark import _where_noloco_behind

    check = {"by_grid": {"8 x 1": {"diff_pct": -2.2, "seeds_holding": 3, "seeds": 3},
                         "4 x 2": {"diff_pct": 0.9, "seeds_holding": 1, "seeds": 3},
                         "8 x 2": {"diff_pct": 5.5, "seeds_holding": 0, "seeds": 3}}}
    assert _where_noloco_behind(check) == (
        "NoLoCo trails DiLoCo in 4 x 2 (+0.90 %, in 2 of 3 seeds only, within the spread between seeds); "
        "8 x 2 (+5.50 %, in every seed) and is ahead in 8 x 1.")
