"""The size-trend benchmark (issue 36): its jobs, its arithmetic and its page, from rows
alone (no run)."""

from __future__ import annotations

import json
from dataclasses import replace

from bench.convergence.runs import job_method
from bench.size_trend import benchmark as bench
from bench.size_trend.answer import answer
from bench.size_trend.plan import FULL, GRID, QUICK, ablation_jobs, method_jobs, tuning_jobs, with_gpu
from swarm_node.config import suggested_lr
from swarm_node.model.config import model_config
from swarm_node.optim import methods
from swarm_node.optim.methods import PAPER_NOLOCO
from swarm_node.optim.outer import OuterHyper


def test_the_full_plan_spans_sizes_seeds_and_both_h_ratios():
    sizes = [sum(_params(s)) for s in with_gpu(FULL).sizes]
    assert sizes[-1] / sizes[0] >= 30  # with the GPU's small model
    body = [_params(s)[0] for s in FULL.sizes]
    # on a CPU: outside the embeddings
    assert len(body) >= 3 and body == sorted(body) and body[-1] / body[0] >= 30
    # norms
    assert all(0 < bench.body_parameters(s) - _params(s)[0] < 0.01 * _params(s)[0] for s in FULL.sizes)
    assert len(FULL.seeds) >= 3 and FULL.steps >= 1000
    jobs = method_jobs(FULL, "debug", "corpus", 1e-3)
    grid = [(j.method, j.plan.h_of(j.method), j.seed) for j in jobs if j.section == "size"]
    for seed in FULL.seeds:
        for method, h in (("ddp", None), ("local", None), ("noloco", 10), ("diloco", 10), ("diloco", 20)):
            assert (method, h, seed) in grid
        low_alpha = [
            j for j in jobs if j.method == "noloco" and j.seed == seed and j.outer_momentum is not None
        ]
        assert [(j.outer_momentum, j.plan.h_of("noloco")) for j in low_alpha] == [(0.3, 10)]
    assert FULL.corpus == "docs" and QUICK.corpus == "bundled"  # the full runs are about one pass, not ten
    assert {j.outer_lr for j in jobs if j.section == "m1" and j.method == "diloco"} == set(FULL.m1_outer_lrs)
    larger = method_jobs(FULL, "tiny", "corpus", 1e-3)  # around the smallest size's best
    assert {j.outer_lr for j in larger if j.section == "m1" and j.method == "diloco"} == set(
        FULL.m1_outer_lrs_larger
    )
    lr = suggested_lr("tiny")
    assert [j.inner_lr for j in tuning_jobs(FULL, "tiny", "corpus")] == [lr / 2, lr, 2 * lr]
    ablations = ablation_jobs(FULL, "tiny", "corpus", 1e-3)
    frozen = [j for j in ablations if j.freeze_embedding]
    assert {j.method for j in frozen} == {"ddp", "diloco", "noloco"}
    assert {j.group_size for j in ablations} == {2, 3, 4}
    halved = [j for j in ablations if j.variant == "inner lr halved"]
    assert {j.method for j in halved} == {"local", "diloco",
                                          "noloco"} and {j.inner_lr for j in halved} == {5e-4}
    assert all(j.seed == FULL.seeds[0] and j.plan.model == "tiny" for j in ablations)
    # NoLoCo's alpha, beta and gamma (the issue's, at the largest size) before the rest
    outer = [j.variant.split()[0] for j in ablations[:5]]
    assert outer == ["alpha", "beta", "beta", "gamma",
                     "gamma"] and all(j.method == "noloco" for j in ablations[:5])


def _params(size: str) -> tuple[int, int]:
    c = model_config(size, vocab_size=4096, max_seq_len=64)
    per_layer = 4 * c.hidden_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer, 2 * c.vocab_size * c.hidden_size


def _run(model, method, seed, loss, variant="", section="size", outer_lr=None, h=10):
    return {"kind": "run", "section": section, "model": model, "method": method, "seed": seed,
            "val_loss": loss,
            "variant": variant, "dp": 4, "num_parameters": 4_000_000 if model == "tiny" else 400_000,
            "tokens": 64_000, "outer_lr": outer_lr, "inner_steps": h if method in ("noloco", "diloco") else 1,
            "cpu_s": 1.0}


def _runs(noloco_over_diloco: dict[str, float]) -> list[dict]:
    runs = []
    for model, gap in noloco_over_diloco.items():
        for seed in (0, 1, 2):
            jitter = 0.001 * seed
            runs += [_run(model, "ddp", seed, 3.0 + jitter), _run(model, "local", seed, 3.5 + jitter),
                     _run(model, "diloco", seed, 3.1 + jitter, "H=20", h=20),
                     _run(model, "diloco", seed, 3.05 + jitter, "H=10"),
                     _run(model, "noloco", seed, (3.1 + jitter) * (1 + gap / 100), "H=10"),
                     _run(model, "noloco", seed, (3.1 + jitter) * (1 + gap / 200), "H=10 alpha 0.3"),
                     _run(model, "ddp", seed, 3.0 + jitter, section="m1"),
                     _run(model, "diloco", seed, 2.99 + jitter, "outer lr 0.7", section="m1", outer_lr=0.7)]
    return runs


CHOSEN = {"debug": {"inner_lr": 3e-3, "m1_outer_lr": 0.7}, "tiny": {"inner_lr": 2e-3, "m1_outer_lr": 0.7}}


def test_the_answer_follows_the_numbers():
    shrinking = bench.trend_rows(_runs({"debug": 5.0, "tiny": 1.0}), CHOSEN, 10)
    ratio = [round(r["noloco_over_diloco_pct"], 3) for r in shrinking if r["against"] == "paper ratio"]
    assert ratio == [5.0, 2.5, 1.0, 0.5]
    assert "shrinks as the model grows" in answer(shrinking)
    assert "grows with the model" in answer(bench.trend_rows(_runs({"debug": 1.0, "tiny": 5.0}), CHOSEN, 10))
    level = answer(bench.trend_rows(_runs({"debug": 0.0, "tiny": 0.0}), CHOSEN, 10))
    assert "does not change" in level and "level with DiLoCo" in level and "no evidence" not in level
    one_seed = [r | {"seeds": 1} for r in bench.trend_rows(_runs({"debug": 5.0, "tiny": 1.0}), CHOSEN, 10)]
    assert answer(one_seed).startswith("One seed, so no spread")
    spread_out = _runs({"debug": 5.0, "tiny": 1.0})
    for r in spread_out:  # debug's seeds spread by 5 points; tiny has only its first seed yet
        if r["model"] == "debug" and r["method"] == "noloco" and r["variant"] == "H=10":
            r["val_loss"] *= 1 + 0.05 * (r["seed"] - 1)
    spread_out = [r for r in spread_out if r["model"] == "debug" or r["seed"] == 0]
    largest_alone = answer(bench.trend_rows(spread_out, CHOSEN, 10))
    assert "no evidence" not in largest_alone and "tiny on one seed so far" in largest_alone
    # 5 % to 1 %, within debug's sd of about 5 points
    assert "does not change beyond the spread" in largest_alone
    assert "+1.00 % (one seed) at" in largest_alone
    assert "level with DiLoCo" in largest_alone  # +1 % at tiny, inside the borrowed spread
    middle = [r for r in _runs({"mini": 3.0}) if r["seed"] == 0]
    in_size_order = {"debug": CHOSEN["debug"], "mini": CHOSEN["tiny"], "tiny": CHOSEN["tiny"]}
    three = answer(bench.trend_rows(spread_out + middle, in_size_order, 10))
    # any size short of seeds, not the ends
    assert "mini and tiny on one seed so far: the spread beside them" in three
    assert "with outer momentum 0.3, NoLoCo's is +2.50 % (sd 0.00, 3 seeds) at 0.11M, +0.50 %" in answer(
        shrinking)  # the low-alpha rows, every size
    assert (
        "With outer momentum 0.3 the gap shrinks as the model grows; at the largest size NoLoCo is behind"
        in (answer(shrinking))
    )  # 2.5 % to 0.5 %, the seeds 0.01 points apart
    one_size = answer(bench.trend_rows(_runs({"debug": 4.0}), {"debug": CHOSEN["debug"]}, 10))
    assert "One size shows no trend" in one_size and "+4.00 %" in one_size and "+2.00 %" in one_size
    assert answer([]).startswith("No size")
    sizes = bench.size_rows(_runs({"debug": 5.0, "tiny": 1.0}), CHOSEN, 64_000)
    budget = answer(shrinking, sizes)
    assert budget.endswith(
        "the same 0.1M tokens, 0.2 a parameter at the smallest and 0.0 at the largest: the trend "
        "is of size and training length together."
    )
    ablations = [{"model": model, "method": method, "ablation": label, "change_pct": change}
                 for model, method, label, change in [("debug", "noloco", "beta 0.5", -9.0),
                                                      ("tiny", "noloco", "beta 0.5", -4.0),
                                                      ("tiny", "noloco", "groups of 3", 0.0),
                                                      ("tiny", "noloco", "alpha 0.7", 6.0),
                                                      ("tiny", "diloco", "frozen input embedding", 9.0)]]
    assert answer(shrinking, sizes, ablations[:-1]).endswith(
        " What moves NoLoCo at tiny (first seed, against its run at the paper's settings, beyond the "
        "spread): alpha 0.7 +6.00 %, beta 0.5 -4.00 %."
    )  # the largest size's, beyond the seeds' spread, largest first
    frozen = [{"model": "tiny", "method": "noloco", "ablation": "frozen input embedding", "change_pct": 10.0}]
    assert answer(shrinking, sizes, ablations + frozen).endswith(
        "beta 0.5 -4.00 %. Run on every method it concerns: frozen input embedding diloco +9.00 %, noloco "
        "+10.00 %."
    )
    assert answer(shrinking, sizes, ablations[2:3]).endswith("None of NoLoCo's settings moves it at tiny "
                                                              "beyond the spread over seeds.")
    # until the largest size has run an ablation, the smaller size's figure stands, named
    only_debug = [{"model": "debug", "method": method, "ablation": label, "change_pct": change}
                  for method, label, change in [("noloco", "groups of 3", 3.0), ("noloco", "alpha 0.7", 7.0),
                                                ("ddp", "frozen input embedding", 11.0),
                                                ("noloco", "frozen input embedding", 12.0)]]
    tiny_ddp_only = [{"model": "tiny", "method": "ddp", "ablation": "frozen input embedding",
                      "change_pct": 2.0}]
    assert answer(shrinking, sizes, only_debug + ablations[1:2] + tiny_ddp_only).endswith(
        " What moves NoLoCo (first seed, against its run at the paper's settings, beyond the spread; each "
        "setting at the largest size that has run it): at tiny beta 0.5 -4.00 %; at debug alpha 0.7 +7.00 %, "
        "groups of 3 +3.00 %. Run on every method it concerns: frozen input embedding at debug ddp +11.00 %, "
        "noloco +12.00 %."
    )
    assert "debug alpha 0.7" not in answer(shrinking, sizes, only_debug + ablations[1:4])  # tiny has run it


def test_size_rows_pair_gaps_by_seed_and_state_tokens_per_parameter():
    rows = bench.size_rows(_runs({"debug": 2.0, "tiny": 2.0}), CHOSEN, train_tokens=32_000)
    local = next(r for r in rows if r["model"] == "tiny" and r["method"] == "local")
    assert abs(local["gap_to_ddp_pct"] - 100 * 0.5 / 3.001) < 0.01 and local["seeds"] == 3
    assert (
        local["parameters"] == 4_000_000 and local["tokens_per_parameter"] == 0.016 and local["epochs"] == 2.0
    )
    m1 = bench.m1_rows(_runs({"debug": 2.0}), {"debug": CHOSEN["debug"]})
    assert m1[0]["gap_to_ddp_pct"] < 0 and m1[0]["sweep_first_seed"] == {"0.7": round(100 * -0.01 / 3.0, 2)}


def test_the_page_renders_from_the_result_alone():
    runs = _runs({"debug": 3.0, "tiny": 1.0})
    ablation = dict(_run("tiny", "noloco", 0, 3.2, "frozen input embedding", section="ablation"))
    rows = (bench.size_rows(runs, CHOSEN, 32_000) + bench.trend_rows(runs, CHOSEN, 10) + bench.m1_rows(runs,
                                                                                                       CHOSEN)
            + bench.ablation_rows(runs + [ablation], 10))
    frozen = next(r for r in rows if r["kind"] == "ablation")
    assert frozen["baseline"] == next(r["val_loss"] for r in runs if r["model"] == "tiny" and r["seed"] == 0
                                      # not alpha 0.3's
                                      and r["method"] == "noloco" and r["variant"] == "H=10")
    result = {"mode": "full", "rows": rows, "notes": [],
              "summary": {"runs": len(runs), "steps": 1000, "global_batch": 64, "seq_len": 64,
                          "grid": "4 x 2", "seeds": [0, 1, 2], "vocab": 4096, "train_tokens": 32_000, "h": 10,
                          "corpus": "docs", "answer": answer(bench.trend_rows(runs, CHOSEN, 10))}}
    page = bench.markdown(result)
    assert (
        "| tiny | noloco H=10 | paper ratio | +1.00" in page
        and "| tiny | frozen input embedding | noloco" in page
    )
    assert "| tiny | noloco H=10 alpha 0.3 | paper ratio | +0.50" in page and "Django" in page
    assert "**Answer.** At the paper's H ratio" in page


def test_the_quick_plan_is_small():
    assert QUICK.steps <= 50 and len(QUICK.seeds) == 1 and len(QUICK.lr_factors) == 1


class _FakeRunner:
    """Runner.run without processes: a row per job with the fields a ledger keys on."""

    def __init__(self):
        self.ran = []

    def run(self, jobs, phase, on_row=lambda row: None):
        rows = []
        for job in jobs:
            self.ran.append(job)
            h = job.plan.h_of(job.method) or 1
            row = {"section": job.section, "model": job.plan.model, "dp": job.dp, "pp": job.pp,
                   "method": job.method,
                   "seed": job.seed, "variant": job.variant, "inner_lr": job.inner_lr,
                   "outer_lr_asked": job.outer_lr,
                   "group_size": job.group_size, "freeze_embedding": job.freeze_embedding,
                   "steps": job.plan.steps,
                   "inner_steps": h if job.method in ("noloco", "diloco") else 1, "val_loss": 3.0}
            outer = job_method(job).outer
            row.update(outer_momentum=outer and outer.alpha, outer_lr=outer and outer.beta,
                       outer_gamma=outer and outer.gamma, nesterov=outer and outer.nesterov)
            on_row(row)
            rows.append(row)
        return rows


def test_a_full_run_stopped_part_way_goes_on_from_its_ledger(tmp_path):
    path = tmp_path / "size_trend.runs.jsonl"
    jobs = method_jobs(FULL, "debug", "corpus", 1e-3) + ablation_jobs(FULL, "debug", "corpus", 1e-3)
    first = _FakeRunner()
    bench.Ledger(path).run(first, jobs[:7], "first session")
    assert len(path.read_text().splitlines()) == 7
    second = _FakeRunner()
    rows = bench.Ledger(path).run(second, jobs, "next session")
    assert second.ran == jobs[7:] and len(rows) == len(jobs)
    assert len(path.read_text().splitlines()) == len(jobs)
    keys = {bench.Ledger(None).job_key(j) for j in jobs}
    assert len(keys) == len(jobs)  # no two jobs of the plan share a key
    other_data = bench.Ledger(path)
    other_data.tag = {"data_sha256": "another corpus", "device": "cpu"}
    fourth = _FakeRunner()
    other_data.run(fourth, jobs[:3], "other tokens")
    assert fourth.ran == jobs[:3]  # runs on other tokens never count as done
    assert all(json.loads(line).get("data_sha256") == "another corpus"
               for line in path.read_text().splitlines()[-3:])
    third = _FakeRunner()
    bench.Ledger(None).run(third, jobs[:2], "quick")  # quick mode keeps no ledger
    assert third.ran == jobs[:2]
    page_only = _FakeRunner()
    unknown = replace(jobs[0], seed=99)
    assert len(bench.Ledger(path, only_known=True).run(page_only, jobs + [unknown], "page")) == len(jobs)
    assert page_only.ran == []  # --from-ledger runs nothing


def test_the_methods_ddp_run_at_the_tuned_lr_is_the_tuning_run(tmp_path):
    """DDP on the first seed at the chosen lr trains exactly what its tuning run did: the
    methods phase takes that row rather than run it again; no other job borrows it."""
    path = tmp_path / "size_trend.runs.jsonl"
    tune = tuning_jobs(FULL, "debug", "corpus")
    bench.Ledger(path).run(_FakeRunner(), tune, "tune")
    chosen = tune[1].inner_lr
    methods = method_jobs(FULL, "debug", "corpus", chosen)
    runner = _FakeRunner()
    rows = bench.Ledger(path).run(runner, methods, "methods")
    borrowed = [j for j in methods if j not in runner.ran]
    assert [(j.section, j.method, j.seed, j.dp) for j in borrowed] == [("size", "ddp", FULL.seeds[0],
                                                                        GRID[0])]
    assert len(rows) == len(methods) and sum(r["section"] == "tune" for r in rows) == 0
    assert len(path.read_text().splitlines()) == len(tune) + len(methods) - 1
    elsewhere = _FakeRunner()  # at an lr no tuning run used, every job runs
    bench.Ledger(path).run(elsewhere, method_jobs(FULL, "debug", "corpus", chosen * 3), "methods")
    assert len(elsewhere.ran) == len(methods)


def test_the_plan_trains_the_papers_noloco_whatever_the_nodes_default(tmp_path, monkeypatch):
    """The trend's NoLoCo rows are the paper's settings (and one named variant): a change
    of the node's default changes none of its runs, and a row trained with other outer
    settings than a job's never answers it."""
    jobs = method_jobs(FULL, "debug", "corpus", 1e-3) + ablation_jobs(FULL, "debug", "corpus", 1e-3)
    trained = [job_method(j) for j in jobs]
    unset = [m.outer for j, m in zip(jobs, trained) if j.method == "noloco" and
             (j.outer_momentum, j.outer_lr, j.outer_gamma) == (None, None, None)]
    assert len(unset) > 3 and set(unset) == {PAPER_NOLOCO}
    monkeypatch.setattr(methods, "NOLOCO_OUTER", OuterHyper(alpha=0.1, beta=0.3, gamma=0.2))
    assert [job_method(j) for j in jobs] == trained
    path = tmp_path / "size_trend.runs.jsonl"
    bench.Ledger(path).run(_FakeRunner(), jobs, "first")
    other = [replace(j, plan=replace(j.plan, noloco_outer=OuterHyper(alpha=0.1, beta=0.3, gamma=0.2)))
             for j in jobs]
    runner = _FakeRunner()
    bench.Ledger(path).run(runner, other, "the node's settings")
    assert runner.ran == [j for j in other if j.method == "noloco"]  # every other run still answered


def test_a_best_inner_lr_on_the_edge_of_the_grid_is_followed_past_it(tmp_path, monkeypatch):
    """DDP's loss falls as the lr falls, down to a quarter of the grid's lowest: the
    tuning steps below the grid twice, and no further."""
    runner = _FakeRunner()
    real_run = runner.run

    def run(jobs, phase, on_row=lambda row: None):
        rows = real_run(jobs, phase, on_row)
        for row in rows:
            row["outer_lr"] = row["outer_lr_asked"]
            m1_sweep = row["section"] == "m1" and row["method"] == "diloco"
            row["val_loss"] = (3.0 + row["inner_lr"] if row["section"] == "tune"
                               else 3.0 - row["outer_lr"] if m1_sweep else 3.0)
        return rows

    runner.run = run

    class Pool:
        def __init__(self, workers, resume_dir=None):
            assert resume_dir is None  # a plan without a ledger (quick mode) keeps no part-way runs

        def __enter__(self):
            return runner

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench, "Runner", Pool)
    monkeypatch.setattr(bench, "subword_data", lambda corpus: "corpus")
    monkeypatch.setattr(bench, "data_identity", lambda spec: "hash")
    plan = FULL
    runs, chosen = bench.run_plan(plan, 1, bench.Ledger(None))
    for size in plan.sizes:
        lowest = suggested_lr(size) * min(FULL.lr_factors)
        tuned = sorted(r["inner_lr"] for r in runs if r["section"] == "tune" and r["model"] == size)
        assert tuned[:3] == [lowest / 4, lowest / 2, lowest] and chosen[size]["inner_lr"] == lowest / 4
        grid = FULL.m1_outer_lrs if size == FULL.sizes[0] else FULL.m1_outer_lrs_larger
        swept = sorted(r["outer_lr"] for r in runs if r["section"] == "m1" and r["method"] == "diloco"
                       and r["seed"] == FULL.seeds[0] and r["model"] == size)
        # M = 1's best on the edge: followed twice
        assert swept == sorted(grid) + [2 * max(grid), 4 * max(grid)]
        assert chosen[size]["m1_outer_lr"] == 4 * max(grid)
    phases = [(j.section, j.plan.model) for j in runner.ran]
    first_tiny_method = phases.index(("size", "tiny"))
    assert all(section in ("tune", "size", "m1") for section, _ in phases[:first_tiny_method])
    assert ("ablation", "debug") in phases[first_tiny_method:]  # whole phases of the smaller size first
    # smallest, largest
    assert {model for section, model in phases if section == "ablation"} == {"debug", "tiny"}
    methods = [j for j in runner.ran if j.section in ("size", "m1")]
    last_first_seed = max(i for i, j in enumerate(methods) if j.seed == FULL.seeds[0] and j.section == "size")
    first_second_seed = min(i for i, j in enumerate(methods) if j.seed == FULL.seeds[1])
    assert last_first_seed < first_second_seed  # every size's first seed before any size's second
    assert {j.plan.model for j in methods[:last_first_seed + 1]} == set(FULL.sizes)
    largest_later_seeds = [i for i, j in enumerate(runner.ran)
                           if j.plan.model == FULL.sizes[-1] and j.seed > 0]
    last_ablation = max(i for i, (section, _) in enumerate(phases) if section == "ablation")
    # the largest size's spread after what the issue asks there
    assert min(largest_later_seeds) > last_ablation
    assert {runner.ran[i].section for i in largest_later_seeds} == {"size", "m1"}
    assert {(j.plan.model, j.seed) for j in runner.ran} == {(m, s) for m in FULL.sizes for s in FULL.seeds}


def _sdist_archive(folder, name, files):
    import io
    import tarfile

    path = folder / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for member, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_docs_corpus_reads_only_the_pinned_files_documentation(tmp_path, monkeypatch):
    import hashlib

    import pytest

    from bench.size_trend import data

    archive = _sdist_archive(tmp_path, "Pkg-1.0", {"docs/intro.txt": "intro", "docs/ref/api.txt": "api",
                                                   "docs/conf.py": "code", "src/notes.txt": "not docs"})
    sdist = data.Sdist("pkg", "1.0", hashlib.sha256(archive.read_bytes()).hexdigest(), "docs", ".txt")
    assert data.fetch_sdist(sdist, tmp_path) == archive  # present and pinned: no download
    assert [text for _, text in data.sdist_documents(sdist, archive)] == ["intro", "api"]
    wrong = data.Sdist("pkg", "1.0", "0" * 64, "docs", ".txt")
    with pytest.raises(data.CorpusError, match="not the pinned"):
        data.fetch_sdist(wrong, tmp_path)
    assert not archive.exists()  # a file that is not the pinned one is not kept

    archive = _sdist_archive(tmp_path, "Pkg-1.0", {"docs/a.txt": "alpha", "docs/b.txt": "beta"})
    sdist = data.Sdist("pkg", "1.0", hashlib.sha256(archive.read_bytes()).hexdigest(), "docs", ".txt")
    monkeypatch.setattr(data, "DOC_SDISTS", (sdist,))
    monkeypatch.setattr(data, "bundled_documents", lambda: ["one", "two", "three"])
    text_dir = data.write_docs_corpus(tmp_path / "text", tmp_path)
    files = sorted(text_dir.glob("*.txt"))
    assert sorted(p.read_text() for p in files) == ["alpha", "beta", "one", "three", "two"]
    assert [p.read_text() for p in files] != ["one", "two", "three", "alpha", "beta"]  # sources interleaved
    assert not (tmp_path / "text.partial").exists()


def test_a_page_from_a_plan_under_way_leaves_out_what_has_no_pair():
    runs = [r for r in _runs({"debug": 3.0}) if not (r["seed"] == 2 and r["method"] == "ddp")]
    runs = [r for r in runs if not (r["section"] == "m1" and r["method"] == "diloco")]
    chosen = {"debug": {"inner_lr": 3e-3, "m1_outer_lr": None}}
    sizes = bench.size_rows(runs, chosen, 32_000)
    assert {r["seeds"] for r in sizes} == {2}  # seed 2 has no DDP run to be paired with yet
    assert bench.m1_rows(runs, chosen) == []
    orphan = _run("debug", "local", 5, 3.3, "inner lr halved", section="ablation")
    assert bench.ablation_rows(runs + [orphan], 10) == []
