"""Benchmark 4, convergence: NoLoCo vs DiLoCo vs DDP vs local-only training at equal
tokens on the bundled real-text corpus, in the paper's DP x PP grids, over several
seeds; and the DiLoCo scaling-law ordering (eval loss over DDP's) at M = 1, 2, 4, 8.

    .venv/bin/python -m bench.convergence [--full] [--workers N]

Every run is the project's in-process simulator (swarm_node.sim) with the real inner
and outer optimizers and random routing between stages. The global batch is fixed and
split over the DP replicas (as in the paper, whose FSDP baseline is one number for all
grids), so every method and grid sees the same tokens per step and in total. Runs are
independent, so they are spread over worker processes with one torch thread each
(tiny models do not gain from intra-op threads; two processes use two cores fully)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass

from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.convergence.stats import (
    METHOD_ORDER,
    SCALING_OUTER_LR,
    SCALING_OUTER_MOMENTUM,
    check_ddp_best,
    check_gaps_grow_with_dp,
    check_noloco_vs_diloco,
    check_scaling_order,
    grid_rows,
    perplexity,
    scaling_rows,
)
from swarm_node.optim.methods import default_method

NAME = "convergence"


@dataclass(frozen=True)
class Plan:
    model: str
    steps: int  # inner steps per worker, the same for every method
    global_batch: int  # sequences per step over all replicas; each of DP replicas gets global_batch / DP
    seq_len: int
    seeds: tuple[int, ...]
    grids: tuple[tuple[int, int], ...]  # (DP, PP)
    scaling_m: tuple[int, ...]  # DiLoCo replicas for the scaling-law ordering (PP = 1)
    eval_batches: int  # of 64 validation windows: 8 is the corpus' whole validation split
    inner_steps: tuple[tuple[str, int], ...] = ()  # H per method where not the project's default

    @property
    def scaling_reference(self) -> tuple[int, int]:
        """The DDP runs the scaling section compares with: the grid M_max x 1."""
        return (max(self.scaling_m), 1)


# Quick: 32 runs in about 3.5 minutes on 2 cores leaves 60 steps per run (about 2 CPU-
# seconds per step for one seed of every grid and M), too few for the default H (50 / 100
# would give DiLoCo no outer round at all), so H is cut to keep 10 / 5 rounds.
# Full: the project's default H over 1000 steps (20 / 10 rounds), about 50 minutes.
QUICK = Plan(model="debug", steps=60, global_batch=32, seq_len=64, seeds=(0, 1),
             grids=((4, 2), (8, 2), (8, 1)), scaling_m=(1, 2, 4, 8), eval_batches=4,
             inner_steps=(("noloco", 6), ("diloco", 12)))
FULL = Plan(model="debug", steps=1000, global_batch=32, seq_len=64, seeds=(0, 1, 2),
            grids=((4, 2), (8, 2), (8, 1)), scaling_m=(1, 2, 4, 8), eval_batches=8)


@dataclass(frozen=True)
class Job:
    section: str  # "grid" or "scaling"
    dp: int
    pp: int
    method: str
    seed: int
    plan: Plan
    outer_lr: float | None = None  # None: the method's default, as for the momentum
    outer_momentum: float | None = None
    nesterov: bool = False

    @property
    def cost(self) -> int:
        """Relative cost, to start the longest runs first: micro-batch passes per step."""
        return self.dp * self.pp


def jobs_for(plan: Plan) -> list[Job]:
    if plan.scaling_reference not in plan.grids:
        raise ValueError(f"the scaling section needs the DDP runs of grid {plan.scaling_reference}")
    jobs = [Job("grid", dp, pp, method, seed, plan)
            for dp, pp in plan.grids for method in METHOD_ORDER for seed in plan.seeds]
    jobs += [Job("scaling", m, 1, "diloco", seed, plan, outer_lr=SCALING_OUTER_LR[m],
                 outer_momentum=SCALING_OUTER_MOMENTUM, nesterov=True)
             for m in plan.scaling_m for seed in plan.seeds]
    return sorted(jobs, key=lambda j: -j.cost)


def sim_config(job: Job):
    from swarm_node.config import default_warmup_steps, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import InnerHyper
    from swarm_node.sim.config import SimConfig

    plan = job.plan
    if plan.global_batch % job.dp:
        raise ValueError(f"global batch {plan.global_batch} does not split over {job.dp} replicas")
    inner = InnerHyper(lr=suggested_lr(plan.model), warmup_steps=default_warmup_steps(plan.steps),
                       total_steps=plan.steps)
    method = default_method(job.method, inner_steps=dict(plan.inner_steps).get(job.method), beta=job.outer_lr,
                            alpha=job.outer_momentum, nesterov=job.nesterov)
    return SimConfig(method=method, inner=inner, data=DataSpec(kind="corpus"),
                     replicas=job.dp, stages=job.pp, model_size=plan.model, seq_len=plan.seq_len,
                     batch_size=plan.global_batch // job.dp, steps=plan.steps, seed=job.seed,
                     eval_batches=plan.eval_batches, eval_batch_size=64)


def _train(sim) -> None:
    """Simulator.run's step loop without its step-0 evaluation, which costs as much as
    the final one and which the benchmark does not report."""
    method = sim.config.method
    for step in range(1, sim.config.steps + 1):
        sim.train_step()
        if method.has_outer_step and step % method.inner_steps == 0:
            sim.outer_round()


def run_job(job: Job) -> dict:
    """One simulator run (in a worker process); returns the flat per-seed row."""
    from swarm_node.sim.simulator import Simulator
    from swarm_node.train.evaluate import path_val_loss

    config = sim_config(job)
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    sim = Simulator(config)
    _train(sim)
    val_loss = sim.evaluate()
    consensus_loss = path_val_loss(sim.consensus_stages(), sim.data, batch_size=config.eval_batch_size,
                                   max_batches=config.eval_batches)
    method = config.method
    return {"kind": "run", "section": job.section, "dp": job.dp, "pp": job.pp, "method": job.method,
            "seed": job.seed, "batch_size": config.batch_size, "inner_steps": method.inner_steps,
            "outer_lr": method.outer.beta if method.outer else None,
            "outer_momentum": method.outer.alpha if method.outer else None,
            "outer_gamma": method.outer.gamma if method.outer else None,
            "nesterov": method.outer.nesterov if method.outer else None,
            "val_loss": val_loss, "ppl": perplexity(val_loss), "consensus_val_loss": consensus_loss,
            "weight_std": max(sim.replica_weight_std()), "outer_rounds": sim.outer_rounds,
            "tokens": config.steps * config.tokens_per_step,
            "num_parameters": sum(p.numel() for stage in sim.workers for p in stage[0].stage.parameters()),
            "val_windows": min(config.eval_batches * config.eval_batch_size, sim.data.num_val_windows),
            "all_val_windows": sim.data.num_val_windows,
            "wall_s": time.perf_counter() - wall_started, "cpu_s": time.process_time() - cpu_started}


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)  # unwinds through the pool's exit, which terminates the workers


def run_all(jobs: list[Job], workers: int) -> list[dict]:
    """Run the jobs on ``workers`` processes; the pool's exit terminates them on any error,
    Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    rows = []
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_one_thread) as pool:
        for n, row in enumerate(pool.imap_unordered(run_job, jobs), 1):
            rows.append(row)
            print(f"[{n}/{len(jobs)}] {row['section']} {row['dp']} x {row['pp']} {row['method']} seed {row['seed']}: "
                  f"ppl {row['ppl']:.3f} ({row['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    return sorted(rows, key=lambda r: (r["section"], r["pp"], r["dp"], r["method"], r["seed"]))


def summarise(result: Result, plan: Plan, runs: list[dict]) -> None:
    grids = grid_rows(runs)
    scaling = scaling_rows(runs, plan.scaling_reference)
    result.rows = grids + scaling + runs
    checks = {"ddp_best": check_ddp_best(grids), "noloco_le_diloco": check_noloco_vs_diloco(grids, runs),
              "gaps_grow_with_dp": check_gaps_grow_with_dp(grids), "scaling_order": check_scaling_order(scaling)}
    first = runs[0]
    result.summary = {
        "model": plan.model, "num_parameters": first["num_parameters"], "steps": plan.steps,
        "global_batch": plan.global_batch, "seq_len": plan.seq_len, "tokens_per_run": first["tokens"],
        "seeds": list(plan.seeds), "scaling_reference": "{} x {}".format(*plan.scaling_reference),
        "checks": checks, "paper_shape_reproduced": all(c["holds"] for c in checks.values()),
        "val_windows": first["val_windows"], "all_val_windows": first["all_val_windows"],
        "run_cpu_s_total": sum(r["cpu_s"] for r in runs),
        "default_inner_steps": {m: default_method(m).inner_steps for m in ("noloco", "diloco")},
    }


# -- the plot --------------------------------------------------------------------
METHOD_COLOURS = {"ddp": "#1f4e79", "noloco": "#2e8b57", "diloco": "#c0642f", "local": "#8c8c8c"}


def _min_max_bars(means: list[float], lows: list[float], highs: list[float]) -> list[list[float]]:
    return [[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]]


def plot(rows: list[dict], path, plt) -> None:
    """Left: perplexity per grid and method (mean, bars min-max over seeds).
    Right: DiLoCo's eval-loss excess over DDP by M, next to the scaling-law paper's."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    per_grid = [r for r in rows if r["kind"] == "grid"]
    grids = list(dict.fromkeys(r["grid"] for r in per_grid))
    for k, method in enumerate(METHOD_ORDER):
        mine = [next((r for r in per_grid if r["grid"] == g and r["method"] == method), None) for g in grids]
        points = [(i + (k - 1.5) * 0.15, r) for i, r in enumerate(mine) if r is not None]
        means = [r["ppl_mean"] for _, r in points]
        left.errorbar([x for x, _ in points], means, fmt="o", capsize=3, color=METHOD_COLOURS[method], label=method,
                      yerr=_min_max_bars(means, [r["ppl_min"] for _, r in points], [r["ppl_max"] for _, r in points]))
    left.set_xticks(range(len(grids)), [f"DP x PP = {g}" for g in grids])
    left.set_ylabel("final validation perplexity (bytes)")
    left.set_title("perplexity at equal tokens (bars: min-max over seeds)")
    left.grid(alpha=0.3, axis="y")
    left.legend()
    scaling = sorted((r for r in rows if r["kind"] == "scaling"), key=lambda r: r["m"])
    ms = [r["m"] for r in scaling]
    means = [r["excess_pct"] for r in scaling]
    right.errorbar(ms, means, fmt="o-", capsize=3, color=METHOD_COLOURS["diloco"], label="DiLoCo, this run",
                   yerr=_min_max_bars(means, [r["excess_min_pct"] for r in scaling],
                                      [r["excess_max_pct"] for r in scaling]))
    for key, style in (("paper_35m_excess_pct", "--"), ("paper_2_4b_excess_pct", ":")):
        right.plot(ms, [r[key] for r in scaling], style, color="#555555",
                   label="paper, " + ("35M" if "35m" in key else "2.4B"))
    right.axhline(0, color=METHOD_COLOURS["ddp"], lw=1, label="DDP")
    right.set_xscale("log", base=2)
    right.set_xticks(ms, [str(m) for m in ms])
    right.set_xlabel("DiLoCo replicas M (PP = 1)")
    right.set_ylabel("eval loss over DDP's (%)")
    right.set_title("DiLoCo scaling-law ordering")
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- BENCHMARKS.md ----------------------------------------------------------------
def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}f} %"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(flag: bool) -> str:
    return "**yes**" if flag else "**no**"


def _h_text(run: dict, defaults: dict) -> str:
    default = defaults[run["method"]]
    return f"H = {run['inner_steps']}" + ("" if run["inner_steps"] == default else
                                          f" (default {default}, cut so the short run has several outer rounds)")


def _momentum_text(run: dict) -> str:
    return f"{'Nesterov' if run['nesterov'] else 'heavy-ball'} momentum {run['outer_momentum']}"


def _setup(result: dict) -> str:
    s = result["summary"]
    runs = [r for r in result["rows"] if r["kind"] == "run"]
    noloco = next(r for r in runs if r["method"] == "noloco")
    diloco = next(r for r in runs if r["method"] == "diloco" and r["section"] == "grid")
    scaling = next(r for r in runs if r["section"] == "scaling")
    defaults = s["default_inner_steps"]
    return (
        "The project's simulator (`swarm_node.sim`: the real AdamW inner step and outer step, a fresh random "
        f"route per micro-batch between stages) trains DP replicas x PP stages of the `{s['model']}` model "
        f"({s['num_parameters']:,} parameters) on the bundled corpus (CPython docstrings, byte tokens): "
        f"{s['steps']} inner steps of a fixed global batch of {s['global_batch']} x {s['seq_len']} tokens, "
        f"split over the DP replicas, so every method and grid sees the same {s['tokens_per_run']:,} tokens. "
        f"Seeds {', '.join(map(str, s['seeds']))}; a seed fixes the initial weights and data order of all methods, "
        "so gaps are paired by seed. Outer hyper-parameters from the project's `default_method`: "
        f"NoLoCo {_h_text(noloco, defaults)}, momentum {noloco['outer_momentum']}, outer lr {noloco['outer_lr']}, "
        f"gamma {noloco['outer_gamma']}, pairs; DiLoCo {_h_text(diloco, defaults)}, momentum "
        f"{diloco['outer_momentum']}, outer lr {diloco['outer_lr']} (heavy-ball, the reference code's). The "
        f"scaling rows take the scaling-law paper's outer optimizer instead: {_momentum_text(scaling)} with "
        "ALGORITHM.md's outer lr by M (section 5). Inner: AdamW at the project's "
        "`debug` lr, warm-up then cosine. Perplexity is exp of the mean validation loss over the fixed paths "
        f"\"worker r at every stage\" on {s['val_windows']} of the corpus's {s['all_val_windows']} held-out "
        "windows (the same for every run); \"consensus\" is one model of each stage's mean weights.")


def _grid_table(rows: list[dict], grid: str) -> str:
    lines = [f"**DP x PP = {grid}**", "",
             "| method | perplexity (mean) | spread: std; min-max | gap to DDP (min..max over seeds) | "
             "consensus ppl | paper ppl (Small, C4) | paper gap to FSDP |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "grid" and r["grid"] == grid):
        gap = "0 (reference)" if r["method"] == "ddp" else \
            f"{_pct(r['gap_to_ddp_pct'], 2)} ({r['gap_min_pct']:+.2f}..{r['gap_max_pct']:+.2f})"
        lines.append(f"| {r['method']} | {r['ppl_mean']:.3f} | {r['ppl_std']:.3f}; {r['ppl_min']:.3f}-"
                     f"{r['ppl_max']:.3f} | {gap} | {r['consensus_ppl_mean']:.3f} | {_num(r['paper_ppl'], 1)} | "
                     f"{_pct(r['paper_gap_pct']) if r['method'] != 'ddp' else '-'} |")
    return "\n".join(lines)


def _scaling_table(result: dict) -> str:
    lines = [f"DiLoCo with M replicas (PP = 1, the same global batch) against DDP on grid "
             f"{result['summary']['scaling_reference']}, eval loss in nats per byte:", "",
             "| M | outer lr, momentum | DiLoCo eval loss (mean ± std) | DDP eval loss | excess over DDP (min..max) | "
             "paper 35M | paper 2.4B |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in result["rows"] if r["kind"] == "scaling"):
        lines.append(f"| {r['m']} | {r['outer_lr']}, {_momentum_text(r)} | "
                     f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | "
                     f"{_num(r['ddp_val_loss_mean'], 4)} | {_pct(r['excess_pct'], 2)} ({r['excess_min_pct']:+.2f}.."
                     f"{r['excess_max_pct']:+.2f}) | {_pct(r['paper_35m_excess_pct'])} | "
                     f"{_pct(r['paper_2_4b_excess_pct'])} |")
    return "\n".join(lines)


def _checks(result: dict) -> str:
    c = result["summary"]["checks"]
    ddp, nd, grow, order = c["ddp_best"], c["noloco_le_diloco"], c["gaps_grow_with_dp"], c["scaling_order"]
    best = ", ".join(f"{g}: {m}" for g, m in ddp["best_by_grid"].items())
    nd_grids = "; ".join(f"{g}: {v['diff_pct']:+.2f} % ({v['seeds_holding']} of {v['seeds']} seeds)"
                         for g, v in nd["by_grid"].items())
    series = "; ".join(f"{name}: " + " -> ".join(f"{gap:+.2f} % (DP {dp})" for dp, gap in zip(v["dp"], v["gap_pct"]))
                       for name, v in grow["series"].items())
    excess = " -> ".join(f"{e:+.2f} % (M {m})" for m, e in zip(order["m"], order["excess_pct"]))
    return "\n".join([
        f"- DDP best in every grid: {_yes(ddp['holds'])} (lowest mean perplexity: {best}); every other method "
        f"behind DDP in every seed: {_yes(ddp['every_seed'])}.",
        f"- NoLoCo at or below DiLoCo in every grid: {_yes(nd['holds'])} (NoLoCo relative to DiLoCo: {nd_grids}).",
        f"- Gaps to DDP grow with DP: {_yes(grow['holds'])} ({series}).",
        f"- DiLoCo's excess over DDP rises with M: {_yes(order['holds'])} ({excess}).",
    ])


CHECK_TITLES = {"ddp_best": "DDP best", "noloco_le_diloco": "NoLoCo at or below DiLoCo",
                "gaps_grow_with_dp": "gaps growing with DP", "scaling_order": "DiLoCo's excess rising with M"}


def _meaning(result: dict) -> str:
    s = result["summary"]
    held = [CHECK_TITLES[n] for n, c in s["checks"].items() if c["holds"]]
    failed = [CHECK_TITLES[n] for n, c in s["checks"].items() if not c["holds"]]
    if not failed:
        text = ("All four checks hold: at equal tokens DDP is best, NoLoCo matches or beats DiLoCo, and the "
                "low-communication methods fall further behind as data parallelism grows, as in the paper's table "
                "and the scaling-law paper.")
    else:
        text = (f"The paper's shape is only partly reproduced. Holds: {', '.join(held) or 'nothing'}. "
                f"Does not hold: {', '.join(failed)}.")
        if not s["checks"]["noloco_le_diloco"]["holds"]:
            text += " " + _where_noloco_behind(s["checks"]["noloco_le_diloco"]) + " " + _why_noloco_behind(
                result["rows"])
        if result["mode"] == "quick":
            text += (f" This is the quick mode, sized for `make bench` ({s['steps']} steps per run): read it as a "
                     "smoke test of the pipeline and run `--full` (longer runs, the project's default H, three "
                     "seeds) for the comparison with the paper.")
    return text + " " + _gaps_against_paper(result["rows"])


def _where_noloco_behind(check: dict) -> str:
    """In which grids NoLoCo trails DiLoCo, and whether every seed says so."""
    behind = {g: v for g, v in check["by_grid"].items() if v["diff_pct"] > 0}
    ahead = [g for g, v in check["by_grid"].items() if v["diff_pct"] <= 0]
    text = "NoLoCo trails DiLoCo in " + "; ".join(
        f"{g} ({v['diff_pct']:+.2f} %, "
        + ("in every seed)" if v["seeds_holding"] == 0 else f"in {v['seeds'] - v['seeds_holding']} of {v['seeds']} "
           "seeds only, within the spread between seeds)") for g, v in behind.items())
    if ahead:
        text += " and is ahead in " + ", ".join(ahead)
    return text + "."


def _why_noloco_behind(rows: list[dict]) -> str:
    """The spread of NoLoCo's workers against DiLoCo's, and how many outer rounds each had."""
    runs = [r for r in rows if r["kind"] == "run" and r["section"] == "grid"]
    spread_of = {m: max(r["weight_std"] for r in runs if r["method"] == m) for m in ("noloco", "diloco")}
    rounds_of = {m: min(r["outer_rounds"] for r in runs if r["method"] == m) for m in ("noloco", "diloco")}
    return (f"Where it trails, a likely reason: NoLoCo's workers of a stage end apart (RMS weight std up to "
            f"{spread_of['noloco']:.1e}, DiLoCo's "
            f"{spread_of['diloco']:.1e} right after its all-worker outer step): a pair average removes less of the "
            "replicas' disagreement per round than DiLoCo's mean over all workers, and here NoLoCo had "
            f"{rounds_of['noloco']} rounds, DiLoCo {rounds_of['diloco']}; the paper's runs have hundreds.")


def _ddp_note(rows: list[dict]) -> str:
    ddp = [r for r in rows if r["kind"] == "grid" and r["method"] == "ddp"]
    values = ", ".join(f"{r['ppl_mean']:.3f} ({r['grid']})" for r in ddp)
    return ("DDP is the same computation in every grid (the same global batch, averaged gradients) except that "
            "each stage clips its own gradient norm, so PP = 1 and PP = 2 clip differently; its perplexity: "
            f"{values}. Each grid's gaps are measured against its own DDP.")


def _gaps_against_paper(rows: list[dict]) -> str:
    """Our gaps to DDP beside the paper's, over the grids both have."""
    pairs = [(r["gap_to_ddp_pct"], r["paper_gap_pct"]) for r in rows
             if r["kind"] == "grid" and r["method"] in ("noloco", "diloco") and r["paper_gap_pct"] is not None]
    text = ("Absolute perplexities are not comparable with the paper's (byte tokens of a small corpus and a tiny "
            "model against BPE tokens of C4 and 125M parameters); compare the gaps to DDP in %.")
    if not pairs:
        return text
    ours, paper = [p[0] for p in pairs], [p[1] for p in pairs]
    text += (f" NoLoCo's and DiLoCo's gaps here span {min(ours):+.1f} % to {max(ours):+.1f} %, "
             f"the paper's in the same grids {min(paper):+.1f} % to {max(paper):+.1f} %.")
    if max(ours) > 2 * max(paper):
        text += " " + _why_gaps_larger(rows)
    return text


def _why_gaps_larger(rows: list[dict]) -> str:
    """Our gaps to DDP are several times the paper's: how little the outer steps add over
    no exchange at all says why (too few rounds to undo the small per-replica batches)."""
    grid = {(r["grid"], r["method"]): r for r in rows if r["kind"] == "grid"}
    local_excess = [100.0 * (grid[g, "local"]["ppl_mean"] / min(grid[g, "noloco"]["ppl_mean"],
                                                                grid[g, "diloco"]["ppl_mean"]) - 1.0)
                    for g, m in grid if m == "local" and (g, "noloco") in grid and (g, "diloco") in grid]
    runs = [r for r in rows if r["kind"] == "run" and r["section"] == "grid" and r["method"] == "noloco"]
    text = ("The gaps are several times the paper's because these runs are short and small: every method sees "
            "the same global batch, split over the DP replicas, so a replica steps on 1/DP of DDP's batch, and "
            "the outer steps must make up for the noisier steps")
    if local_excess and runs:
        text += (f"; with only {min(r['outer_rounds'] for r in runs)} NoLoCo rounds they make up little of it: "
                 f"training with no exchange at all (`local`) ends only {min(local_excess):+.1f} % to "
                 f"{max(local_excess):+.1f} % behind the better of NoLoCo and DiLoCo")
    return text + ". The paper trains for 25k steps, with hundreds of rounds."


def markdown(result: dict) -> str:
    grids = list(dict.fromkeys(r["grid"] for r in result["rows"] if r["kind"] == "grid"))
    parts = [
        "## convergence: NoLoCo vs DiLoCo vs DDP vs local at equal tokens",
        f"{result['mode'].capitalize()} run, {result['wall_s']:.0f} s on {result['machine']['cpu_count']} CPUs:",
        f"```bash\n{rerun_command(NAME, result['mode'])}\n```",
        _setup(result),
        "![convergence](bench/results/convergence.png)",
        *(_grid_table(result["rows"], g) for g in grids),
        _scaling_table(result),
        "**Does it reproduce the paper's shape?**",
        _checks(result),
        _meaning(result),
        _ddp_note(result["rows"]),
    ]
    if result["notes"]:
        parts.append("\n".join(f"- {n}" for n in result["notes"]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=lambda p: p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="parallel simulator processes (default: CPUs)"))
    plan = FULL if args.full else QUICK
    result = Result(NAME, args.mode, args.out_dir)
    started = time.perf_counter()
    runs = run_all(jobs_for(plan), max(1, args.workers))
    summarise(result, plan, runs)
    cpu_s = result.summary["run_cpu_s_total"]
    result.note(f"{len(runs)} simulator runs on {args.workers} processes of one torch thread each: "
                f"{time.perf_counter() - started:.0f} s wall, {cpu_s:.0f} CPU-seconds inside the runs, so about "
                f"{cpu_s / args.workers:.0f} s on {args.workers} otherwise idle cores; the wall time grows with "
                "whatever else the machine runs, the CPU time much less.")
    plot(result.rows, result.path(".png"), pyplot())
    result.write()
    return 0
