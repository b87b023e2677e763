"""Benchmark: does NoLoCo keep up with DiLoCo as the model grows? DDP, DiLoCo (at
NoLoCo's H and at twice it, the paper's ratio), NoLoCo and local-only at equal tokens on
subword text (BPE 4k; data.py says which), 4 x 2, per model size over seeds; DiLoCo with
one replica against DDP; ablations per size.

    .venv/bin/python -m bench.size_trend [--full] [--workers N] [--device cuda] [--sizes debug,tiny]

Every run is the project's simulator through bench/convergence/runs.py (the real inner
and outer optimizers, random routing between stages). Jobs: plan.py; data: data.py; the
answer paragraph: answer.py."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.convergence.plan import Job
from bench.convergence.runs import Runner, job_method
from bench.size_trend.answer import answer
from bench.size_trend.data import DATA_ROOT, VOCAB, data_identity, subword_data
from bench.size_trend.plan import (
    FULL,
    LOW_ALPHA,
    M1_H,
    QUICK,
    SizePlan,
    ablation_jobs,
    deferred,
    m1_confirming_jobs,
    m1_job,
    method_jobs,
    seed_major,
    tuning_jobs,
    with_gpu,
)
from swarm_node.config import suggested_lr
from swarm_node.model.config import model_config

NAME = "size_trend"
CORPUS_TEXT = {"bundled": "the bundled corpus (stdlib docstrings)",
               "docs": "the bundled corpus and the documentation of Django 5.1.4 and SQLAlchemy 2.0.36"}
MAX_LR_EXTENSIONS = 2  # lrs tried past the edge of a grid when the best lies on it (inner, and M = 1's outer)
METHODS = ("ddp", "local", "noloco", "diloco")


def label(row: dict) -> str:
    return f"{row['method']} {row['variant']}".strip()


class Ledger:
    """The runs of a long plan, one JSON line each as it finishes (``path``; None keeps
    nothing): a plan stopped part-way, or continued in another session from the committed
    file, runs only the jobs it has no row for. A job is known by what it trains.
    ``only_known``: run nothing, answer with the rows there are (a page from a plan
    still under way)."""

    def __init__(self, path: Path | None, only_known: bool = False):
        self.path = path
        self.only_known = only_known
        self.tag: dict = {}  # written into every row and part of its key: the data's hash and the device
        self.rows: dict[tuple, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                self.rows[self.row_key(row)] = row

    def job_key(self, job: Job) -> tuple:
        method = job_method(job)
        inner_lr = job.inner_lr if job.inner_lr is not None else suggested_lr(job.plan.model)
        outer = method.outer
        return (self.tag.get("data_sha256"), self.tag.get("device"), job.section, job.plan.model, job.dp,
                job.pp,
                job.method, job.seed, job.variant, round(inner_lr, 12), job.outer_lr, job.group_size,
                job.freeze_embedding, job.plan.steps, method.inner_steps,
                *(_outer_key(outer.alpha, outer.beta, outer.gamma,
                             outer.nesterov) if outer else _outer_key()))

    @staticmethod
    def row_key(row: dict) -> tuple:
        return (row.get("data_sha256"), row.get("device"), row["section"], row["model"], row["dp"], row["pp"],
                row["method"], row["seed"], row["variant"], round(row["inner_lr"], 12), row["outer_lr_asked"],
                row["group_size"], row["freeze_embedding"], row["steps"], row["inner_steps"],
                *_outer_key(row["outer_momentum"], row["outer_lr"], row["outer_gamma"], row["nesterov"]))

    def known(self, key: tuple) -> dict | None:
        """The row of the run ``key`` names. A methods-phase run that trains exactly what a
        tuning run did (DDP, first seed, the chosen lr: the keys differ only in the section)
        is that run: a tiny one is 40 CPU-minutes."""
        if key in self.rows:
            return self.rows[key]
        tuned = self.rows.get((*key[:2], "tune", *key[3:])) if key[2] == "size" else None
        return None if tuned is None else {**tuned, "section": "size"}

    def run(self, runner: Runner, jobs: list[Job], phase: str) -> list[dict]:
        found = [self.known(self.job_key(j)) for j in jobs]
        known = [row for row in found if row is not None]
        todo = [j for j, row in zip(jobs, found) if row is None]
        if known:
            print(f"{phase}: {len(known)} of {len(jobs)} runs already in {self.path.name}", file=sys.stderr)
        if not todo or self.only_known:
            return known
        return known + runner.run(todo, phase, on_row=self._write)

    def _write(self, row: dict) -> None:
        row.update(self.tag)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _outer_key(alpha=None, beta=None, gamma=None, nesterov=None) -> tuple:
    """The outer settings a run trained with, resolved: a row answers a job only if they
    match, so a change of the node's defaults never passes an old run off as a new one."""
    return (*(None if v is None else round(v, 12) for v in (alpha, beta, gamma)), nesterov)


def run_plan(plan: SizePlan, workers: int, ledger: Ledger) -> tuple[list[dict], dict]:
    """Phase by phase across the sizes (tuning, the methods seed by seed, the M = 1 sweep,
    its confirmations and the ablations at the smallest and the largest size, then the
    largest size's other seeds: plan.deferred), so a plan stopped part-way holds whole
    phases, and every size's first seed before any size's second."""
    data = subword_data(plan.corpus)
    ledger.tag = {"data_sha256": data_identity(data), "device": plan.device}
    # with a ledger, a run a stopped process left part-way goes on from where it was
    resume = (
        DATA_ROOT / "partial" / f"{ledger.tag['data_sha256'][:16]}-{plan.device}" if ledger.path else None
    )
    with Runner(workers, resume_dir=resume) as runner:
        tuned = _by_size(ledger.run(runner, [j for s in plan.sizes for j in tuning_jobs(plan, s, data)],
                                    "tune"))
        for _ in range(MAX_LR_EXTENSIONS):  # a best lr at the edge of the grid: look one step beyond it
            beyond = [replace(tuning_jobs(plan, size, data)[0], inner_lr=lr) for size, rows in tuned.items()
                      if (lr := _beyond_edge(rows, "inner_lr")) is not None]
            found = _by_size(ledger.run(runner, beyond, "tune beyond the edge"))
            if not found:
                break
            for size, rows in found.items():
                tuned[size] += rows
        sizes = [s for s in plan.sizes if s in tuned]  # only_known: the sizes tuned so far
        inner = {size: min(tuned[size], key=lambda r: r["val_loss"])["inner_lr"] for size in sizes}
        methods = seed_major(plan, [j for s in sizes for j in method_jobs(plan, s, data, inner[s])])
        main = _by_size(ledger.run(runner, [j for j in methods if not deferred(plan, j)], "methods"))
        for _ in range(MAX_LR_EXTENSIONS):  # M = 1's best outer lr at the edge of its sweep: one step past it
            beyond = [m1_job(plan, size, data, inner[size], lr) for size, rows in main.items()
                      if (lr := _beyond_edge(_m1_sweep(rows), "outer_lr")) is not None]
            found = _by_size(ledger.run(runner, beyond, "M = 1 outer lr beyond the edge"))
            if not found:
                break
            for size, rows in found.items():
                main[size] += rows
        outer = {size: min(sweep, key=lambda r: r["val_loss"])["outer_lr"] for size, rows in main.items()
                 if (sweep := _m1_sweep(rows))}
        confirming = [j for s in outer for j in m1_confirming_jobs(plan, s, data, inner[s], outer[s])]
        later = [j for j in confirming if not deferred(plan, j)]
        later += [j for s in dict.fromkeys((plan.sizes[0], plan.sizes[-1])) if s in inner
                  for j in ablation_jobs(plan, s, data, inner[s])]
        later += [j for j in methods + confirming if deferred(plan, j)]
        rest = _by_size(ledger.run(runner, later, "confirmations, ablations, the largest size's other seeds"))
    runs = [r for size in sizes for r in tuned[size] + main.get(size, []) + rest.get(size, [])]
    chosen = {size: {"inner_lr": inner[size], "m1_outer_lr": outer.get(size)} for size in sizes}
    return runs, chosen


def _by_size(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["model"], []).append(row)
    return out


def _m1_sweep(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["section"] == "m1" and r["method"] == "diloco"]


def _beyond_edge(tuned: list[dict], lr_key: str) -> float | None:
    """The next lr (``lr_key`` of the rows) to try when the best so far is the lowest or
    highest tried."""
    lrs = sorted(r[lr_key] for r in tuned)
    if len(lrs) < 2:
        return None
    best = min(tuned, key=lambda r: r["val_loss"])[lr_key]
    if lrs[0] < best < lrs[-1]:
        return None
    return best / 2 if best == lrs[0] else best * 2


def body_parameters(size: str) -> int:
    """Parameters outside the input embedding and the LM head, the size the trend is drawn
    on: with a 4k vocabulary the two are most of the smaller models' parameters (Kaplan et
    al.'s scaling laws leave the vocabulary's parameters out of a model's size too, and
    find cleaner trends so)."""
    config = model_config(size, vocab_size=VOCAB, max_seq_len=64)
    return config.num_parameters() - 2 * config.vocab_size * config.hidden_size


def _gap_pct(value: float, reference: float) -> float:
    return 100.0 * (value - reference) / reference


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def size_rows(runs: list[dict], chosen: dict, train_tokens: int) -> list[dict]:
    """Per size and method: the loss over seeds and its gap to DDP, paired by seed."""
    rows = []
    for size, picks in chosen.items():
        mine = [r for r in runs if r["model"] == size and r["section"] == "size"]
        ddp = {r["seed"]: r["val_loss"] for r in mine if r["method"] == "ddp"}
        mine = [r for r in mine if r["seed"] in ddp]  # a plan under way: seeds whose DDP run is done
        if not mine:
            continue
        params = mine[0]["num_parameters"]  # one replica's, every stage
        for name in sorted({label(r) for r in mine}, key=lambda n: (METHODS.index(n.split()[0]), n)):
            runs_of = [r for r in mine if label(r) == name]
            loss, loss_sd = _spread([r["val_loss"] for r in runs_of])
            gap, gap_sd = _spread([_gap_pct(r["val_loss"], ddp[r["seed"]]) for r in runs_of])
            rows.append({"kind": "size", "model": size, "parameters": params,
                         "body_parameters": body_parameters(size), "method": name,
                         "seeds": len(runs_of), "val_loss": loss, "val_loss_sd": loss_sd,
                         "gap_to_ddp_pct": gap, "gap_to_ddp_pct_sd": gap_sd,
                         "tokens": runs_of[0]["tokens"],
                         "tokens_per_parameter": runs_of[0]["tokens"] / params,
                         "epochs": runs_of[0]["tokens"] / train_tokens, "inner_lr": picks["inner_lr"]})
    return rows


def trend_rows(runs: list[dict], chosen: dict, h: int) -> list[dict]:
    """NoLoCo (the paper's settings, and outer momentum 0.3) against DiLoCo per size, paired by
    seed: at the paper's H ratio and at equal H."""
    rows = []
    for size in chosen:
        mine = [r for r in runs if r["model"] == size and r["section"] == "size"]
        for noloco_variant in (f"H={h}", f"H={h} alpha {LOW_ALPHA:g}"):
            noloco = {r["seed"]: r["val_loss"] for r in mine if r["method"] == "noloco"
                      and r["variant"] == noloco_variant}
            for variant, what in ((f"H={2 * h}", "paper ratio"), (f"H={h}", "equal H")):
                diloco = {r["seed"]: r["val_loss"] for r in mine
                          if r["method"] == "diloco" and r["variant"] == variant}
                gaps = [_gap_pct(noloco[s], diloco[s]) for s in noloco if s in diloco]
                if not gaps:
                    continue
                gap, sd = _spread(gaps)
                rows.append({"kind": "trend", "model": size, "parameters": mine[0]["num_parameters"],
                             "body_parameters": body_parameters(size),
                             "noloco": f"noloco {noloco_variant}", "against": what,
                             "noloco_over_diloco_pct": gap, "sd": sd, "seeds": len(gaps), "per_seed": gaps})
    return rows


def m1_rows(runs: list[dict], chosen: dict) -> list[dict]:
    rows = []
    for size, picks in chosen.items():
        mine = [r for r in runs if r["model"] == size and r["section"] == "m1"]
        ddp = {r["seed"]: r["val_loss"] for r in mine if r["method"] == "ddp"}
        best = [r for r in mine if r["method"] == "diloco" and r["outer_lr"] == picks["m1_outer_lr"]
                and r["seed"] in ddp]
        if not best:  # no sweep yet (m1_outer_lr None), or no seed of the best paired with DDP
            continue
        gap, sd = _spread([_gap_pct(r["val_loss"], ddp[r["seed"]]) for r in best])
        sweep = {f"{r['outer_lr']:g}": round(_gap_pct(r["val_loss"], ddp[r["seed"]]), 2) for r in mine
                 if r["method"] == "diloco" and r["seed"] == min(ddp)}
        rows.append({"kind": "m1", "model": size, "outer_lr": picks["m1_outer_lr"], "gap_to_ddp_pct": gap,
                     "sd": sd,
                     "seeds": len(best), "sweep_first_seed": sweep})
    return rows


def ablation_rows(runs: list[dict], h: int) -> list[dict]:
    """Each ablation against the same method's run at its defaults, same size and seed."""
    rows = []
    for r in (r for r in runs if r["section"] == "ablation"):
        variant = f"H={h}" if r["method"] in ("noloco", "diloco") else ""
        base = next(
            (
                b
                for b in runs
                if b["section"] == "size"
                and b["model"] == r["model"]
                and b["seed"] == r["seed"]
                and b["method"] == r["method"]
                and b["variant"] == variant
            ),
            None,
        )
        if base is None:
            continue
        rows.append({"kind": "ablation", "model": r["model"], "method": r["method"], "ablation": r["variant"],
                     "val_loss": r["val_loss"], "baseline": base["val_loss"],
                     "change_pct": _gap_pct(r["val_loss"], base["val_loss"])})
    return rows


def summarise(result: Result, plan: SizePlan, runs: list[dict], chosen: dict) -> None:
    from swarm_node.data.dataset import load_windows
    from swarm_node.data.spec import DataSpec

    windows = load_windows(DataSpec.parse(subword_data(plan.corpus)), plan.seq_len)
    train_tokens = windows.num_train_windows * (plan.seq_len + 1)
    sizes, trend = size_rows(runs, chosen, train_tokens), trend_rows(runs, chosen, plan.h)
    ablations = ablation_rows(runs, plan.h)
    result.rows = sizes + trend + m1_rows(runs, chosen) + ablations + runs
    result.summary = {"sizes": list(plan.sizes), "corpus": plan.corpus, "steps": plan.steps,
                      "seeds": list(plan.seeds), "grid": "4 x 2", "h": plan.h,
                      "global_batch": plan.global_batch, "seq_len": plan.seq_len, "vocab": VOCAB,
                      "train_tokens": train_tokens, "chosen": chosen,
                      "answer": answer(trend, sizes, ablations),
                      "run_cpu_s_total": sum(r["cpu_s"] for r in runs), "runs": len(runs),
                      "device": plan.device}


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [r for r in rows if r["kind"] == "size"]
    for method in sorted({r["method"] for r in sizes if not r["method"].startswith("ddp")}):
        points = sorted((r for r in sizes if r["method"] == method), key=lambda r: r["body_parameters"])
        ax.errorbar([p["body_parameters"] for p in points], [p["gap_to_ddp_pct"] for p in points],
                    yerr=[p["gap_to_ddp_pct_sd"] for p in points], marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("parameters outside the embeddings, one replica")
    ax.set_ylabel("validation loss over DDP's (%)")
    ax.set_title("gap to DDP by model size (4 x 2, subword text; bars: sd over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> str:
    s, rows = result["summary"], result["rows"]
    lines = [
        f"## {NAME}: does NoLoCo keep up with DiLoCo as the model grows?",
        "",
        f"```bash\n{rerun_command(NAME, result['mode'])}\n```",
        "",
        f"{s['runs']} simulator runs, {s['steps']} inner steps each, global batch {s['global_batch']} x "
        f"{s['seq_len']} tokens, grid {s['grid']}, seeds {s['seeds']}; {CORPUS_TEXT[s['corpus']]} in "
        f"BPE-{s['vocab']} tokens ({s['train_tokens']:,} training tokens); NoLoCo at H = {s['h']} (outer "
        f"momentum 0.5, the paper's, and {LOW_ALPHA:g}, the node's default), DiLoCo at H = {s['h']} and "
        f"{2 * s['h']}; inner lr tuned per size for DDP and used by every method.",
        "",
        f"![{NAME}](bench/results/{NAME}.png)",
        "",
        "Parameters are one replica's, all stages, and (the size the plot is drawn on) those outside the "
        "input embedding and the LM head, which are most of the smaller models' parameters; tokens per "
        "parameter count all of them; epochs are passes over the training tokens.",
        "",
        "| size | parameters: all, outside the embeddings | tokens / parameter | epochs | method | seeds | "
        "val loss | over DDP (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] == "size"):
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.2f}M, {r['body_parameters'] / 1e6:.2f}M | "
                     f"{r['tokens_per_parameter']:.1f} | "
                     f"{r['epochs']:.1f} | {r['method']} | {r['seeds']} | "
                     f"{r['val_loss']:.4f} ± {r['val_loss_sd']:.4f} | "
                     f"{r['gap_to_ddp_pct']:+.2f} ± {r['gap_to_ddp_pct_sd']:.2f} |")
    lines += ["", "NoLoCo over DiLoCo, paired by seed:", "",
              "| size | NoLoCo | against DiLoCo at | NoLoCo over DiLoCo (%) |", "|---|---|---|---|"]
    lines += [
        f"| {r['model']} | {r['noloco']} | {r['against']} | {r['noloco_over_diloco_pct']:+.2f} ± "
        f"{r['sd']:.2f} |"
        for r in rows
        if r["kind"] == "trend"
    ]
    m1 = [r for r in rows if r["kind"] == "m1"]
    if m1:
        lines += [
            "",
            "DiLoCo with one replica (M = 1, Nesterov 0.9, outer lr swept on the first seed) against DDP:",
            "",
            "| size | outer lr | seeds | over DDP (%) | sweep (first seed) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['model']} | {r['outer_lr']:g} | {r['seeds']} | {r['gap_to_ddp_pct']:+.2f} ± {r['sd']:.2f} "
            f"| {', '.join(f'{k}: {v:+.2f}' for k, v in r['sweep_first_seed'].items())} |"
            for r in m1
        ]
        lines += ["", "The round itself costs M = 1 nothing: an outer step of lr 1 without momentum trains "
                      "exactly as DDP does (tests/sim/test_simulator.py), so a gap here is the outer step's "
                      f"momentum and lr over this plan's rounds ({s['steps']} steps at H = {M1_H}: "
                      f"{s['steps'] // M1_H} of them)."]
    ablations = [r for r in rows if r["kind"] == "ablation"]
    if ablations:
        lines += ["", "Ablations (first seed), against the same method's run at its defaults:", "",
                  "| size | ablation | method | val loss | change (%) |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['model']} | {r['ablation']} | {r['method']} | {r['val_loss']:.4f} | "
            f"{r['change_pct']:+.2f} |"
            for r in ablations
        ]
    lines += ["", f"**Answer.** {s['answer']}"]
    lines += [f"\n{n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"


def _options(parser) -> None:
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="parallel simulator processes (default: CPUs)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda adds the small model to the sizes")
    parser.add_argument("--from-ledger", action="store_true",
                        help="with --full: run nothing, write the page from the runs the ledger holds")
    parser.add_argument(
        "--sizes",
        type=lambda text: tuple(text.split(",")),
        default=None,
        help="comma-separated model sizes, smallest first (default: the plan's); a long plan can "
        "finish one size per sitting",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=_options)
    if args.from_ledger and not args.full:
        raise SystemExit("--from-ledger reads the --full plan's ledger: add --full")
    plan = FULL if args.full else QUICK
    if args.device == "cuda":
        plan = with_gpu(plan)
    if args.sizes:
        plan = replace(plan, sizes=args.sizes)
    result = Result(NAME, args.mode, args.out_dir)
    started = time.perf_counter()
    ledger = Ledger(args.out_dir / f"{NAME}.runs.jsonl" if args.full else None, only_known=args.from_ledger)
    runs, chosen = run_plan(plan, max(1, args.workers), ledger)
    summarise(result, plan, runs, chosen)
    if args.from_ledger:
        result.wall_s = sum(r["wall_s"] for r in runs)
        result.note(
            f"A plan under way: this page holds the {len(runs)} runs its ledger has so far "
            f"({result.wall_s:.0f} s of runs one after another, {result.summary['run_cpu_s_total']:.0f} "
            f"CPU-seconds, one torch thread each); `--full` goes on from them."
        )
    else:
        result.note(
            f"{len(runs)} runs on {args.workers} processes of one torch thread each: "
            f"{time.perf_counter() - started:.0f} s wall, {result.summary['run_cpu_s_total']:.0f} "
            f"CPU-seconds."
        )
    plot(result.rows, result.path(".png"))
    result.write()
    print(f"bench.{NAME}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0
