"""The boundary-codec benchmark (issue 55): its plan fits the issue's grid and budget, its
ledger knows a run by what it trains, and its answer reads the curve at width 768
(rows alone, no run)."""

from __future__ import annotations

import json

from bench.boundary_codec import benchmark as bench
from bench.boundary_codec.plan import CODEC, TOKENS_PER_RUN, full_jobs, planned_cpu_s, quick_jobs


def test_the_full_plan_is_the_issues_grid_within_its_budget():
    jobs = full_jobs("manifest:x")
    wide = [j for j in jobs if j.model == "small"]
    assert all(j.layers == 4 for j in wide)
    curve = {j.ratio for j in wide if j.section == "curve" and j.codec == CODEC}
    assert {8.0, 16.0, 32.0, 64.0} <= curve and CODEC == "bottleneck8"
    assert {(j.codec, j.ratio, j.seed) for j in wide if j.section == "seed"} == {("fp16", None, 1),
                                                                                 (CODEC, 32.0, 1)}
    narrow = {(j.model, j.codec) for j in jobs if j.section == "width"}
    assert narrow == {(m, c) for m in ("tiny", "mini") for c in ("fp16", "int8", CODEC)}
    assert all(j.steps * j.global_batch * j.seq_len >= TOKENS_PER_RUN for j in jobs)
    assert all((j.dp, j.pp, j.h) == (4, 2, 10) for j in jobs)
    assert sum(planned_cpu_s(j) for j in jobs) <= 60 * 3600
    assert len({json.dumps(j.key_fields(), sort_keys=True) for j in jobs}) == len(jobs)
    assert [j.section for j in jobs] == sorted((j.section for j in jobs),
                                               key=["curve", "seed", "width"].index)


def _row(model, codec, seed, loss, ratio=None, hidden=768):
    return {"kind": "run", "model": model, "layers": 4 if model == "small" else None, "codec": codec,
            "ratio": ratio,
            "seed": seed, "hidden": hidden, "width": 45, "bits": 8, "forward_bytes_per_token": 47.3,
            "backward_bytes_per_token": 45.8, "ratio_achieved": 32.5, "val_loss": loss, "tokens": 8_003_584,
            "cpu_s": 1.0}


def test_the_answer_is_the_best_ratio_within_two_percent_of_fp16_over_paired_seeds():
    runs = [_row("small", "fp16", 0, 3.0), _row("small", "fp16", 1, 3.1),
            _row("small", CODEC, 0, 3.03, 16.0), _row("small", CODEC, 0, 3.05, 32.0),
            _row("small", CODEC, 1, 3.17, 32.0), _row("small", CODEC, 0, 3.3, 64.0),
            _row("small", "bottleneck4", 0, 3.01, 64.0),  # another codec: not on the curve
            _row("tiny", "fp16", 0, 3.5, hidden=256), _row("tiny", CODEC, 0, 3.6, 32.0, hidden=256)]
    compares = bench.compare_rows(runs)
    assert len(compares) == len(runs)
    gaps = {(r["model"], r["ratio"], r["seed"]): round(r["gap_to_fp16_pct"], 3) for r in compares}
    assert gaps[("small", 32.0, 1)] == round(100 * 0.07 / 3.1, 3)  # paired with its own seed's fp16
    got = bench.answer(compares)
    assert got["best_ratio_within_target"] == 32.0 and got["seeds"]["32"] == 2 and got["meets_target"]
    assert abs(got["gap_pct_at_best"] - (100 * 0.05 / 3 + 100 * 0.07 / 3.1) / 2) < 1e-9


def test_the_ledger_knows_a_run_by_what_it_trains(tmp_path):
    job = quick_jobs("manifest:x")[1]
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps({**job.key_fields(), "section": "other", "data_sha256": "abc",
                                "val_loss": 1.0}) + "\n")
    ledger = bench.Ledger(path)
    ledger.tag = {"data_sha256": "abc"}
    assert ledger.known(job)["val_loss"] == 1.0
    ledger.tag = {"data_sha256": "other data"}
    assert ledger.known(job) is None


def test_the_page_and_the_plot_render_from_rows(tmp_path):
    runs = [_row("small", "fp16", 0, 3.0), _row("small", CODEC, 0, 3.05, 32.0),
            _row("small", "bottleneck4", 0, 3.1, 32.0), _row("tiny", "fp16", 0, 3.5, hidden=256),
            _row("tiny", "int8", 0, 3.5, hidden=256)]
    compares = bench.compare_rows(runs)
    result = {"mode": "full", "rows": compares + runs, "notes": ["a note"],
              "summary": {"runs": len(runs), "tokens": 8_003_584, "answer": bench.answer(compares)}}
    page = bench.markdown(result)
    assert "32x: +1.67 (1 seeds)" in page and "| 768 | bottleneck4 | 32x |" in page
    bench.plot(result["rows"], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
