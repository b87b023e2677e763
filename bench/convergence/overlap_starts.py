"""Where the inner steps beside an overlapped exchange should start (ALGORITHM.md 3.1):
the convergence benchmark's wire grid (4 x 2, H = 10, 1,000 steps, phi, Delta and
activations in 16 bits) at the NoLoCo setting and inner lr of its last full result, the
exchange half a round long (or one, or two), against the blocking round on the same seeds.

Starts (SimConfig.overlap_start): "local", the node's rule; "theta", theta as it was;
and, to split the rule's gap into its parts, starts no node can have at the boundary:
the group's outer step with the partners' Delta known ("known-deltas"), with their phi
known ("known-phis"), or both ("known", which is the blocking round reordered).
Landings (SimConfig.outer_landing): "whole", phi and Delta together; "delta-first",
Delta sent ahead of phi. Lateness: the exchange half a round, one or two rounds long (two:
the node waits a round; with Delta ahead of phi it waits first, for the Delta).

    .venv/bin/python -m bench.convergence.overlap_starts [--seeds 0,1,2] [--starts local,known-deltas]
        [--landings whole,delta-first] [--lates half,one,two] [--result overlap_landings]

Writes bench/results/overlap_starts.json (or --result's name); 1.5 to 5.5 minutes a run
on one core of these machines (they differ), half of it the loss curve's evaluations."""

from __future__ import annotations

import os
import sys
import time

from bench.common.results import Result, load, parse_mode
from bench.convergence.plan import FULL, NOLOCO_DEFAULT, Job, noloco_override, wire_label
from bench.convergence.runs import Runner
from bench.convergence.stats import wire_rows
from swarm_node.sim.config import OUTER_LANDINGS, OVERLAP_STARTS

NAME = "overlap_starts"
BASELINE = "blocking fp16"


LATES = {"half": ("half a round", 0.5), "one": ("one round", 1.0), "two": ("two rounds", 2.0)}


def jobs(seeds: list[int], starts: list[str], inner_lr: float, choice: str, landings: tuple[str,
                                                                                            ...] = ("whole",),
         lates: tuple[str, ...] = ("half",)) -> list[Job]:
    dp, pp = FULL.wire_grid
    override = {} if choice == NOLOCO_DEFAULT else noloco_override(*_split(choice))
    h = FULL.h_of("noloco")

    def job(label: str, seed: int, **kw) -> Job:
        return Job("wire", dp, pp, "noloco", seed, FULL, inner_lr=inner_lr, variant=wire_label(label, choice),
                   outer_codec="fp16", activation_codec="fp16", **override, **kw)

    def label(late: str, start: str, landing: str) -> str:
        return (f"overlapped, {LATES[late][0]} late, start: {start}"
                + ("" if landing == "whole" else f", landing: {landing}"))

    return ([job(BASELINE, seed) for seed in seeds]
            + [job(label(late, start, landing), seed, outer_latency_steps=round(LATES[late][1] * h),
                   overlap_start=start, outer_landing=landing)
               for late in lates for landing in landings for start in starts for seed in seeds])


def _split(choice: str) -> tuple[str, float]:
    setting, value = choice.split(" = ")
    return setting, float(value)


def main(argv: list[str] | None = None) -> int:
    def options(parser) -> None:
        parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default: %(default)s)")
        parser.add_argument("--starts", default=",".join(OVERLAP_STARTS),
                            help="comma-separated (default: all)")
        parser.add_argument("--landings", default="whole", help="comma-separated (default: %(default)s)")
        parser.add_argument("--lates", default="half", help="comma-separated, of half, one and two "
                                                            "(default: %(default)s)")
        parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
        parser.add_argument("--result", default=NAME, help="the result's name under bench/results "
                                                           "(default: %(default)s)")

    args = parse_mode(__doc__.split("\n\n")[0], argv, extra=options)
    convergence = load("convergence")
    if convergence is None or convergence["mode"] != "full":
        print(f"bench.{NAME}: needs a full bench/results/convergence.json (its inner lr and NoLoCo choice)",
              file=sys.stderr)
        return 2
    starts = args.starts.split(",")
    unknown = [s for s in starts if s not in OVERLAP_STARTS]
    if unknown:
        print(f"bench.{NAME}: unknown start(s) {unknown}; choose from {OVERLAP_STARTS}", file=sys.stderr)
        return 2
    landings, lates = tuple(args.landings.split(",")), tuple(args.lates.split(","))
    if any(landing not in OUTER_LANDINGS for landing in landings) or any(late not in LATES for late in lates):
        print(f"bench.{NAME}: landings are {OUTER_LANDINGS}, lates {tuple(LATES)}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    inner_lr, choice = convergence["summary"]["inner_lr"], convergence["summary"]["noloco_choice"]
    result = Result(args.result, args.mode, args.out_dir)
    started = time.perf_counter()
    with Runner(max(1, args.workers)) as runner:
        runs = runner.run(jobs(seeds, starts, inner_lr, choice, landings, lates), NAME)
    result.rows = wire_rows(runs, BASELINE) + runs
    result.summary = {"seeds": seeds, "inner_lr": inner_lr, "noloco_choice": choice,
                      "landings": list(landings),
                      "lates": list(lates),
                      "gaps_pct": {r["variant"]: round(r["gap_pct"], 3) for r in result.rows
                                   if r.get("kind") == "wire" and r["gap_pct"] is not None}}
    result.note(f"{len(runs)} runs on {args.workers} processes: {time.perf_counter() - started:.0f} s wall.")
    result.write()
    for variant, gap in result.summary["gaps_pct"].items():
        print(f"{variant}: {gap:+.2f} % against the blocking round", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
