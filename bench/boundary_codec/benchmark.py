"""Benchmark: a coded stage boundary (docs/ALGORITHM.md section 9) against fp16 activations
at equal tokens: the ratio-cost curve at width 768, the chosen ratio on a second seed,
and fp16 / int8 / the chosen ratio at two narrower widths (plan.py says what and why).

    .venv/bin/python -m bench.boundary_codec [--full] [--workers N] [--device cuda] [--sections curve,seed]

Every run is the project's simulator (random routing, NoLoCo's rounds, the wire codec
on every hop as the node encodes it). ``--full`` keeps a ledger
(bench/results/boundary_codec.runs.jsonl) and a stopped plan goes on from it, a run
cut short from its last save; ``--quick`` takes seconds."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from bench.boundary_codec.plan import (
    CHOSEN_RATIO,
    CODEC,
    METHOD_CHECK,
    PRECISION_CHECK,
    CodecJob,
    full_jobs,
    quick_jobs,
)
from bench.boundary_codec.runs import run_job
from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.size_trend.data import DATA_ROOT, data_identity, subword_data

NAME = "boundary_codec"
TARGET_PCT, STRETCH = 2.0, (100.0, 1.0)  # the acceptance: within +2 %; stretch 100x at +1 %


class Ledger:
    """The full plan's runs, one JSON line each as it finishes; a job is known by what it
    trains (CodecJob.key_fields) and the data's hash and device it ran on."""

    def __init__(self, path: Path | None, only_known: bool = False):
        self.path, self.only_known = path, only_known
        self.tag: dict = {}
        self.rows: dict[str, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                self.rows[self._key(row)] = row

    @staticmethod
    def _key(fields: dict) -> str:
        wanted = {k: v for k, v in fields.items()
                  if k in CodecJob.__dataclass_fields__ or k in ("data_sha256",)}
        wanted.pop("section", None)
        wanted.pop("data", None)
        return json.dumps(wanted, sort_keys=True)

    def known(self, job: CodecJob) -> dict | None:
        return self.rows.get(self._key({**job.key_fields(), **self.tag}))

    def run(self, jobs: list[CodecJob], workers: int, resume_dir: Path | None) -> list[dict]:
        found = [self.known(j) for j in jobs]
        rows = [{**r, "section": j.section} for j, r in zip(jobs, found) if r is not None]
        todo = [j for j, r in zip(jobs, found) if r is None]
        if rows:
            print(f"{len(rows)} of {len(jobs)} runs already in {self.path.name}", file=sys.stderr)
        if not todo or self.only_known:
            return rows
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_one_thread) as pool:
            for n, row in enumerate(pool.imap_unordered(partial(run_job, resume_dir=resume_dir), todo), 1):
                row.update(self.tag)
                if self.path is not None:
                    with open(self.path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                rows.append(row)
                print(f"[{n}/{len(todo)}] {row['label']}: loss {row['val_loss']:.4f}, "
                      f"{row['forward_bytes_per_token']:.1f} B/token ({row['cpu_s']:.0f} CPU-s)",
                      file=sys.stderr, flush=True)
        return rows


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _gap(value: float, reference: float) -> float:
    return 100.0 * (value - reference) / reference


def compare_rows(runs: list[dict]) -> list[dict]:
    """Every run against fp16 on the same width and seed: its loss gap and its bytes."""
    fp16 = {(r["model"], r["layers"], r["seed"]): r for r in runs if r["codec"] == "fp16"}
    rows = []
    for r in runs:
        ref = fp16.get((r["model"], r["layers"], r["seed"]))
        if ref is None:
            continue
        rows.append({"kind": "compare", "model": r["model"], "layers": r["layers"], "hidden": r["hidden"],
                     "codec": r["codec"], "ratio": r["ratio"], "seed": r["seed"], "width": r["width"],
                     "bits": r["bits"], "forward_bytes_per_token": r["forward_bytes_per_token"],
                     "backward_bytes_per_token": r["backward_bytes_per_token"],
                     "ratio_achieved": r["ratio_achieved"], "val_loss": r["val_loss"],
                     "gap_to_fp16_pct": _gap(r["val_loss"], ref["val_loss"]), "tokens": r["tokens"],
                     "cpu_s": r["cpu_s"]})
    return rows


def answer(compares: list[dict]) -> dict:
    """The best ratio whose loss is within TARGET_PCT of fp16 at width 768, as the mean of
    its paired seeds (a ratio with one seed only is provisional)."""
    wide = [r for r in compares if r["hidden"] == 768 and r["codec"] == CODEC]
    by_ratio: dict[float, list[float]] = {}
    for r in wide:
        by_ratio.setdefault(r["ratio"], []).append(r["gap_to_fp16_pct"])
    within = {ratio: statistics.mean(gaps) for ratio, gaps in by_ratio.items()
              if statistics.mean(gaps) <= TARGET_PCT}
    best = max(within, default=None)
    return {"curve": {f"{ratio:g}": statistics.mean(g) for ratio, g in sorted(by_ratio.items())},
            "seeds": {f"{ratio:g}": len(g) for ratio, g in sorted(by_ratio.items())},
            "best_ratio_within_target": best, "gap_pct_at_best": within.get(best),
            "meets_target": best is not None and best >= 32 and len(by_ratio[best]) >= 2}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    compares = [r for r in rows if r["kind"] == "compare"]
    for hidden in sorted({r["hidden"] for r in compares}):
        mine = sorted(
            (r for r in compares if r["hidden"] == hidden and r["codec"] == CODEC and r["seed"] == 0),
            key=lambda r: r["ratio"],
        )
        ax.plot([r["ratio_achieved"] for r in mine], [r["gap_to_fp16_pct"] for r in mine], "o-",
                label=f"{CODEC}, width {hidden}")
    for codec, marker in (("int8", "s"), (PRECISION_CHECK, "^"), (METHOD_CHECK, "v")):
        points = [r for r in compares if r["codec"] == codec]
        if points:
            ax.plot([r["ratio_achieved"] for r in points], [r["gap_to_fp16_pct"] for r in points], marker,
                    label=codec)
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(TARGET_PCT, color="red", lw=0.8, ls="--", label=f"+{TARGET_PCT:g} %")
    ax.set_xlabel("compression against fp16 (bytes a token, ids and frames counted)")
    ax.set_ylabel("validation loss over fp16 (%)")
    ax.set_title("coded stage boundary: loss at equal tokens (4 x 2 NoLoCo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> str:
    s, rows = result["summary"], result["rows"]
    lines = [
        f"## {NAME}: a coded stage boundary against fp16 activations",
        "",
        f"```bash\n{rerun_command(NAME, result['mode'])}\n```",
        "",
        f"{s['runs']} simulator runs, 4 x 2 NoLoCo, {s['tokens']:,} tokens each; the codec `{CODEC}` sized "
        f"per ratio with every byte on the wire counted (values, steps, token ids, frame).",
        "",
        f"![{NAME}](bench/results/{NAME}.png)",
        "",
        "| width | codec | ratio asked | values a token (bits) | bytes a token fwd / back | seed | val loss "
        "| over fp16 (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] == "compare"):
        ratio = "" if r["ratio"] is None else f"{r['ratio']:g}x"
        lines.append(
            f"| {r['hidden']} | {r['codec']} | {ratio} | {r['width']} ({r['bits']}) | "
            f"{r['forward_bytes_per_token']:.1f} / {r['backward_bytes_per_token']:.1f} | {r['seed']} | "
            f"{r['val_loss']:.4f} | {r['gap_to_fp16_pct']:+.2f} |"
        )
    a = s["answer"]
    curve = ", ".join(f"{k}x: {v:+.2f} ({a['seeds'][k]} seeds)" for k, v in a["curve"].items()) or "none yet"
    lines += ["",
              f"**Answer.** Curve at width 768 (gap to fp16, %, mean over seeds): {curve}; best ratio within "
                  f"+{TARGET_PCT:g} %: {a['best_ratio_within_target']}."]
    lines += [f"\n{n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"


def _options(parser) -> None:
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="parallel simulator processes of one torch thread each (default: CPUs)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--sections",
        type=lambda text: tuple(text.split(",")),
        default=None,
        help="with --full: only these of curve, seed, width (a long plan one part per sitting)",
    )
    parser.add_argument("--ratio", type=float, default=CHOSEN_RATIO,
                        help="with --full: the ratio the second seed and the narrower widths run at")
    parser.add_argument("--from-ledger", action="store_true",
                        help="with --full: run nothing, write the page from the runs the ledger holds")


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=_options)
    started = time.perf_counter()
    data = subword_data("docs" if args.full else "bundled")
    jobs = full_jobs(data, args.device, args.ratio) if args.full else quick_jobs(data)
    if args.sections:
        jobs = [j for j in jobs if j.section in args.sections]
    ledger = Ledger(args.out_dir / f"{NAME}.runs.jsonl" if args.full else None, only_known=args.from_ledger)
    ledger.tag = {"data_sha256": data_identity(data)}
    resume = DATA_ROOT / "partial" / f"{NAME}-{ledger.tag['data_sha256'][:16]}" if args.full else None
    runs = ledger.run(jobs, max(1, args.workers), resume)
    result = Result(NAME, args.mode, args.out_dir)
    compares = compare_rows(runs)
    result.rows = compares + runs
    result.summary = {"runs": len(runs), "tokens": max((r["tokens"] for r in runs), default=0),
                      "codec": CODEC, "answer": answer(compares),
                      "run_cpu_s_total": sum(r["cpu_s"] for r in runs)}
    result.note(f"{len(runs)} runs, {result.summary['run_cpu_s_total']:.0f} CPU-seconds in all "
                f"({time.perf_counter() - started:.0f} s wall here).")
    plot(result.rows, result.path(".png"))
    result.write()
    print(f"bench.{NAME}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0
