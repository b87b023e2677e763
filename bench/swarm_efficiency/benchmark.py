"""Benchmark 3, swarm efficiency: tokens/s of a local swarm (``swarm-node local``, 2 stages
x 2 replicas and 1 stage x 4 replicas) against plain single-process training of the same
model on the same machine in the same invocation, and where the difference goes.

Plain training is a ``StageWorker`` holding the whole model (one stage: forward, loss,
backward, the same inner AdamW and schedule, batches of the same corpus), in this
process, with as many torch threads as the swarm's nodes have together (``swarm-node
local`` gives each node ``OMP_NUM_THREADS=1`` and ``--threads 1``), and also with one
thread per core. The swarm runs as ``python -m bench.swarm_efficiency.probe local ...``:
the real driver and node processes, each node timestamping its inner steps, micro-batches
and outer rounds and profiling itself (see bench/swarm_efficiency/probe.py), while this process
samples per-thread CPU time of the whole process tree from /proc.

Steady state: the window from the last stage-0 node reaching inner step A to the first
reaching step B (start-up, the first steps, the end and the final evaluation lie
outside); swarm tokens/s = stage-0 micro-batch samples completed (backward done) in the
window x seq_len / window. The JSON summary of ``swarm-node local --json-out`` is kept
too: its ``tokens_per_s`` (whole run, start-up and evaluation included) is reported
next to the steady rate.

Breakdown, per stage, of each node's compute thread over the window: its CPU time
(schedstat) split by its cProfile (CPU-time timer, inner steps A..B) into useful work
(forward, backward, inner step: what plain training does), recomputation (the forward
that ``StageWorker.backward`` re-runs), (de)serialisation (``encode_frame`` /
``decode_frame``), outer rounds and other (checks of peer data, batch loading); its
runqueue wait (runnable, no core free); and the rest, idle (waiting for peers, the
pipeline, rounds, or the GIL). Machine-wide, every CPU-second of the window goes to one
of those compute buckets, the nodes' event loops, hivemind's DHT processes, the p2pd
daemons, the driver (with the bootstrap DHT), other processes, or idle.

``summary`` keys: ``model``, ``num_parameters``, ``seq_len``, ``batch_size``,
``inner_steps``, ``window_steps``, ``plain_threads``, ``cores``, ``tokens_per_s_plain``
(and ``_cores``: one thread per core), ``tokens_per_s``, ``ratio`` (swarm/plain tokens/s),
``ratio_cores`` and ``cpu_ratio`` (swarm/plain tokens per CPU-second of all their
processes, which other load on the machine does not skew), all dicts by layout
``"SxR"``; ``daemon_cpu_share`` (by layout: p2pd's share of the swarm's CPU time);
``other_processes_max`` (the largest share of the machine other processes took during
a measurement); and ``step_time_s`` = ``{"mean": s, "std": s, "n": count, "layout":
"2x2"}``, the inner-step time of the 2 x 2 swarm's nodes in the window (time between
consecutive inner steps, intervals holding an outer round left out), which the
latency-model benchmark reads.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from bench.common.results import Result, parse_mode
from bench.swarm_efficiency import analysis as ana
from bench.swarm_efficiency.fast_link import FAST_LINK_FULL, FAST_LINK_QUICK, run_fast_link
from bench.swarm_efficiency.report import NAME, markdown, plot  # noqa: F401  (bench.report renders through markdown)
from bench.swarm_efficiency.swarm import (
    FULL,
    QUICK,
    LayoutAnalysis,
    Plan,
    analyse_swarm,
    layout_name,
    measure_plain,
    plain_rows,
    run_swarm,
    threads_per_node,
)


def run(plan: Plan, result: Result, fast_link: Plan | None = None) -> None:
    from swarm_node.data.dataset import load_windows

    data = load_windows(plan.spec(1).data, plan.seq_len)
    budget = max(stages * replicas for stages, replicas in plan.layouts) * threads_per_node()
    cores = os.cpu_count() or 1
    plains = {threads: measure_plain(plan, threads, data) for threads in dict.fromkeys((budget, cores))}
    reference, per_core = plains[budget]["tokens_per_s"], plains[cores]["tokens_per_s"]
    with tempfile.TemporaryDirectory(prefix="swarm-efficiency-") as work:
        analyses = {layout_name(*layout): analyse_swarm(run_swarm(plan, *layout, Path(work)), plan)
                    for layout in plan.layouts}
    plain_tables = {threads: plain_rows(plain, reference) for threads, plain in plains.items()}
    cpu_reference = plain_tables[budget][0]["tokens_per_cpu_s"]
    for throughput, machine in plain_tables.values():
        throughput["cpu_ratio"] = throughput["tokens_per_cpu_s"] / cpu_reference
        result.add(**throughput)
        result.add(**machine)
    for analysis in analyses.values():
        analysis.throughput["ratio"] = analysis.throughput["tokens_per_s"] / reference
        analysis.throughput["ratio_cores"] = analysis.throughput["tokens_per_s"] / per_core
        analysis.throughput["cpu_ratio"] = ana.ratio(analysis.throughput["tokens_per_cpu_s"], cpu_reference)
        result.add(**analysis.throughput)
        for row in analysis.stages:
            result.add(**row)
        result.add(**analysis.machine)
    _summarise(result, plan, plains, budget, cores, analyses)
    if fast_link is not None:
        with tempfile.TemporaryDirectory(prefix="swarm-efficiency-fast-") as work:
            run_fast_link(fast_link, result, Path(work))


def _summarise(result: Result, plan: Plan, plains: dict, budget: int, cores: int,
               analyses: dict[str, LayoutAnalysis]) -> None:
    latency_layout = "2x2" if "2x2" in analyses else next(iter(analyses))
    swarm_cpu = {name: 1.0 - a.machine["other_processes"] - a.machine["idle"] for name, a in analyses.items()}
    result.summary.update(
        {
            "model": plan.model,
            "num_parameters": plains[budget]["num_parameters"],
            "seq_len": plan.seq_len,
            "batch_size": plan.batch_size,
            "inner_steps": plan.inner_steps,
            "window_steps": list(plan.window),
            "round_timeout_s": plan.round_timeout_s,
            "plain_threads": budget,
            "cores": cores,
            "tokens_per_s_plain": plains[budget]["tokens_per_s"],
            "tokens_per_s_plain_cores": plains[cores]["tokens_per_s"],
            "tokens_per_s": {name: a.throughput["tokens_per_s"] for name, a in analyses.items()},
            "ratio": {name: a.throughput["ratio"] for name, a in analyses.items()},
            "ratio_cores": {name: a.throughput["ratio_cores"] for name, a in analyses.items()},
            "cpu_ratio": {name: a.throughput["cpu_ratio"] for name, a in analyses.items()},
            "other_processes_max": max(
                row["other_processes"] for row in result.rows if row["table"] == "machine"
            ),
            "daemon_cpu_share": {
                name: (a.machine["p2pd"] / swarm_cpu[name] if swarm_cpu[name] > 0 else None)
                for name, a in analyses.items()
            },
            "step_time_s": {**ana.mean_std(analyses[latency_layout].step_times), "layout": latency_layout},
        }
    )
    result.note(
        "Plain training (in the benchmark process) and every swarm node's compute thread run under cProfile "
        "with a CPU-time timer, so both sides pay its overhead."
    )
    result.note(f"Steady state: stage-0 inner steps {plan.window[0]}..{plan.window[1]} of {plan.steps}, "
                f"outer rounds every {plan.inner_steps} inner steps (NoLoCo pairs).")


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.splitlines()[0], argv)
    plan, fast = (FULL, FAST_LINK_FULL) if args.full else (QUICK, FAST_LINK_QUICK)
    result = Result(NAME, args.mode, args.out_dir)
    run(plan, result, fast)
    path = result.write()
    plot(json.loads(path.read_text()), result.path(".png"))
    return 0
