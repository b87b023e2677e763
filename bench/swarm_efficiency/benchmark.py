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

import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import ROOT as REPO
from bench.common.results import Result, parse_mode, pyplot, rerun_command
from bench.swarm_efficiency import analysis as ana
from bench.swarm_efficiency.probe import MODULE as PROBE_MODULE
from bench.swarm_efficiency.probe import PROBE_DIR_ENV, PROFILE_STEPS_ENV, TreeSampler

NAME = "swarm_efficiency"


def threads_per_node() -> int:
    """Torch threads ``swarm-node local`` gives each node (its OMP_NUM_THREADS and --threads)."""
    from swarm_node.local.swarm import LocalConfig  # imports hivemind: only once a swarm is wanted

    return LocalConfig.threads_per_node


@dataclass(frozen=True)
class Plan:
    model: str
    seq_len: int
    batch_size: int
    steps: int  # inner steps of each stage-0 node
    inner_steps: int  # H
    window: tuple[int, int]  # stage-0 inner steps delimiting the steady state
    plain_warmup_steps: int
    plain_steps: int
    swarm_timeout_s: float
    layouts: tuple[tuple[int, int], ...] = ((2, 2), (1, 4))  # (stages, replicas)
    data: str = "corpus"
    round_timeout_s: float = 15.0  # swarm-node local's default: how long a node seeks a partner

    def spec(self, num_stages: int):
        """The run spec ``swarm-node local`` builds from the same flags (cli._run_local)."""
        from swarm_node.config import default_warmup_steps, suggested_lr
        from swarm_node.data.spec import DataSpec
        from swarm_node.optim import InnerHyper, default_method
        from swarm_node.spec import RunSpec

        return RunSpec(run_id="bench-plain", model_size=self.model, num_stages=num_stages, seq_len=self.seq_len,
                       batch_size=self.batch_size, samples_per_step=self.batch_size, total_steps=self.steps,
                       data=DataSpec.parse(self.data), method=default_method("noloco", inner_steps=self.inner_steps),
                       inner=InnerHyper(lr=suggested_lr(self.model), warmup_steps=default_warmup_steps(self.steps),
                                        total_steps=self.steps))


# "tiny" (4 layers x 256, 3.5M parameters with the byte vocabulary): an inner step of 8 x 64
# tokens is ~0.3 CPU-seconds, against which the per-micro-batch costs of the swarm (a
# frame of activations, a stream through p2pd, the event loop) are a small fraction, as
# they would be on real hardware; "debug" (2 x 64) steps in milliseconds and would measure
# only those costs; "small" (85M) needs several CPU-seconds per step and would not fit
# the quick budget. seq_len 64 and batch 8 are swarm-node local's defaults.
QUICK = Plan(model="tiny", seq_len=64, batch_size=8, steps=46, inner_steps=20, window=(4, 44),
             plain_warmup_steps=2, plain_steps=16, swarm_timeout_s=300)
FULL = Plan(model="tiny", seq_len=64, batch_size=8, steps=240, inner_steps=50, window=(15, 215),
            plain_warmup_steps=5, plain_steps=150, swarm_timeout_s=900)


def layout_name(stages: int, replicas: int) -> str:
    return f"{stages}x{replicas}"


# --- plain training ---------------------------------------------------------------------


def machine_cpu() -> tuple[float, float]:
    with open("/proc/stat") as f:
        return ana.parse_cpu_line(f.readline(), os.sysconf("SC_CLK_TCK"))


def measure_plain(plan: Plan, threads: int, data) -> dict:
    """Steady tokens/s of single-process training with ``threads`` torch threads, under
    the same profiler as the swarm's compute threads (so both pay its overhead)."""
    from swarm_node.data.shards import ShardedBatches
    from swarm_node.train.worker import StageWorker

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spec = plan.spec(num_stages=1)
        worker = StageWorker(spec, 0, data.vocab_size)
        loader = ShardedBatches(data, batch_size=plan.batch_size, seed=spec.seed, shard_id=0, num_shards=1)

        def one_step() -> None:
            inputs, targets = loader.next_batch()
            worker.forward_backward_last(None, targets, inputs)
            worker.step()

        for _ in range(plan.plain_warmup_steps):
            one_step()
        profile = cProfile.Profile(time.thread_time)
        busy0, idle0 = machine_cpu()
        cpu0 = time.process_time()
        times = [time.monotonic()]
        profile.enable()
        for _ in range(plan.plain_steps):
            one_step()
            times.append(time.monotonic())
        profile.disable()
        cpu = time.process_time() - cpu0
        busy1, idle1 = machine_cpu()
    finally:
        torch.set_num_threads(previous)
    profile.create_stats()
    window = times[-1] - times[0]
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"threads": threads, "tokens_per_s": plan.plain_steps * plan.batch_size * plan.seq_len / window,
            "window_s": window, "step_time": ana.mean_std(steps), "cpu_s": cpu,
            "other_cpu_s": ana.compute_buckets(profile.stats)["other"],
            "machine_busy": busy1 - busy0, "machine_idle": idle1 - idle0,
            "num_parameters": sum(p.numel() for p in worker.params)}


# --- the swarm --------------------------------------------------------------------------


@dataclass
class SwarmRun:
    stages: int
    replicas: int
    summary: dict  # what swarm-node local --json-out wrote
    nodes: list[dict]  # the probes' records (see probe.NodeProbe)
    compute_profiles: dict[int, dict]  # node pid -> pstats table of its compute thread
    samples: list[ana.Sample]


def run_swarm(plan: Plan, stages: int, replicas: int, work_dir: Path, *, lanes: bool = True) -> SwarmRun:
    """One ``swarm-node local`` run with probed nodes, its process tree sampled meanwhile;
    ``lanes`` False: everything over libp2p streams (``--no-lanes``)."""
    probe_dir = work_dir / (layout_name(stages, replicas) + ("" if lanes else "-libp2p"))
    probe_dir.mkdir()
    summary_path = probe_dir / "summary.json"
    cmd = [sys.executable, "-m", PROBE_MODULE, "local", "--stages", str(stages), "--replicas", str(replicas),
           "--model", plan.model, "--data", plan.data, "--seq-len", str(plan.seq_len),
           "--batch-size", str(plan.batch_size), "--steps", str(plan.steps), "--inner-steps", str(plan.inner_steps),
           "--round-timeout", str(plan.round_timeout_s),
           "--run-dir", str(probe_dir / "run"), "--json-out", str(summary_path), "--no-progress",
           *([] if lanes else ["--no-lanes"])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **{PROBE_DIR_ENV: str(probe_dir), PROFILE_STEPS_ENV: f"{plan.window[0]}:{plan.window[1]}"})
    log_path = probe_dir / "driver.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    sampler = TreeSampler(driver.pid)
    code = None
    try:
        with sampler:
            code = driver.wait(timeout=plan.swarm_timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _stop_swarm(driver, sampler.samples, clean=code == 0)
    if code != 0 or not summary_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"swarm-node local {layout_name(stages, replicas)} failed (exit {code}):\n{tail}")
    nodes = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("node-*[0-9].json"))]
    profiles = {n["pid"]: pstats.Stats(str(probe_dir / f"node-{n['pid']}-compute.prof")).stats for n in nodes}
    return SwarmRun(stages, replicas, json.loads(summary_path.read_text()), nodes, profiles, sampler.samples)


def _stop_swarm(driver: subprocess.Popen, samples: list[ana.Sample], clean: bool) -> None:
    """The driver stops its nodes on SIGTERM. After a failure, whatever is left of the
    driver's process group and of its children's (each node leads its own) is killed."""
    if driver.poll() is None:
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    if not clean:
        children = {task.pid for sample in samples for task in sample.tasks.values() if task.ppid == driver.pid}
        for group in (driver.pid, *children):
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    driver.wait()


# --- analysis -----------------------------------------------------------------------------

COMPUTE_COLUMNS = ("useful", "recompute", "serialisation", "outer", "other")
MACHINE_COLUMNS = (*COMPUTE_COLUMNS, "event_loops", "dht", "p2pd", "driver", "other_processes", "idle")


@dataclass
class LayoutAnalysis:
    throughput: dict
    stages: list[dict]
    machine: dict
    step_times: list[float]


def analyse_swarm(run: SwarmRun, plan: Plan) -> LayoutAnalysis:
    stage0 = [n for n in run.nodes if n["stage"] == 0]
    start, end = ana.steady_window([n["step_times"] for n in stage0], *plan.window)
    window = end - start
    samples = sum(ana.count_between(n["sample_times"], n["samples"], start, end) for n in stage0)
    step_times = [dt for n in run.nodes
                  for dt in ana.interval_stats(n["step_times"], _closed_rounds(n["rounds"], end), start, end)]
    round_times = [finish - begin for n in run.nodes for begin, finish in _closed_rounds(n["rounds"], end)
                   if start <= begin <= end]
    threads = {n["pid"]: ana.NodeThreads(n["pid"], n["stage"], n["compute_tid"]) for n in run.nodes}
    cpu = ana.cpu_accounting(run.samples, threads, start, end)
    name = layout_name(run.stages, run.replicas)
    peers = run.summary["peers"]
    throughput = {"table": "throughput", "layout": name, "processes": len(run.nodes),
                  "torch_threads": len(run.nodes) * threads_per_node(),
                  "tokens_per_s": samples * plan.seq_len / window, "window_s": window,
                  "tokens_per_s_whole_run": run.summary["tokens_per_s"], "wall_s": run.summary["wall_s"],
                  "step_time_mean_s": ana.mean_std(step_times)["mean"],
                  "step_time_std_s": ana.mean_std(step_times)["std"],
                  "round_time_mean_s": ana.mean_std(round_times)["mean"],
                  "outer_rounds": sum(p["outer_rounds"] for p in peers),
                  "rounds_with_partner": sum(p["rounds_with_partner"] for p in peers),
                  "microbatches_lost": sum(p["microbatches_lost"] for p in peers),
                  "final_val_loss": run.summary["final_val_loss"]}
    swarm_cpu_s = sum(cpu["roles"].values())
    throughput["tokens_per_cpu_s"] = samples * plan.seq_len / swarm_cpu_s if swarm_cpu_s > 0 else None
    stage_shares = _stage_shares(run)
    stages = [_stage_row(name, stage, cpu["stages"].get(stage, {}), stage_shares[stage],
                         sum(n["stage"] == stage for n in run.nodes) * window) for stage in sorted(stage_shares)]
    machine = _machine_row(name, cpu, stage_shares)
    throughput["other_processes"] = machine["other_processes"]
    return LayoutAnalysis(throughput, stages, machine, step_times)


def _closed_rounds(rounds: list[list[float]], end: float) -> list[list[float]]:
    """A round still open at shutdown lasts to the end of the window."""
    return [[start, finish if finish == finish else end] for start, finish in rounds]  # NaN: open


def _stage_shares(run: SwarmRun) -> dict[int, dict[str, float]]:
    """Per stage, the mean over its nodes of the compute thread's profile shares."""
    by_stage: dict[int, list[dict[str, float]]] = {}
    for node in run.nodes:
        buckets = ana.compute_buckets(run.compute_profiles[node["pid"]])
        by_stage.setdefault(node["stage"], []).append(ana.shares(buckets))
    return {stage: {c: sum(s[c] for s in shares) / len(shares) for c in COMPUTE_COLUMNS}
            for stage, shares in by_stage.items()}


def _stage_row(layout: str, stage: int, cpu: dict[str, float], shares: dict[str, float], node_seconds: float) -> dict:
    """Fractions of one node's window (mean over the stage's nodes): its compute thread's
    buckets, runqueue wait and idle time, and its other processes' CPU in cores."""
    busy = cpu.get("compute", 0.0) / node_seconds
    wait = cpu.get("compute_wait", 0.0) / node_seconds
    row = {"table": "stages", "layout": layout, "stage": stage}
    row.update({column: busy * shares[column] for column in COMPUTE_COLUMNS})
    row.update({"wait_for_core": wait, "idle": max(0.0, 1.0 - busy - wait),
                "event_loop_cores": cpu.get("event_loop", 0.0) / node_seconds,
                "dht_cores": cpu.get("dht", 0.0) / node_seconds, "p2pd_cores": cpu.get("p2pd", 0.0) / node_seconds})
    return row


def _machine_row(layout: str, cpu: dict, stage_shares: dict[int, dict[str, float]]) -> dict:
    """Shares of the machine's CPU time in the window (all cores together)."""
    total = cpu["machine_busy"] + cpu["machine_idle"]
    row = {"table": "machine", "layout": layout}
    for column in COMPUTE_COLUMNS:
        row[column] = sum(cpu["stages"][s].get("compute", 0.0) * shares[column]
                          for s, shares in stage_shares.items()) / total
    roles = cpu["roles"]
    row.update({"event_loops": roles.get("event_loop", 0.0) / total, "dht": roles.get("dht", 0.0) / total,
                "p2pd": roles.get("p2pd", 0.0) / total, "driver": roles.get("driver", 0.0) / total,
                "other_processes": max(0.0, cpu["machine_busy"] - sum(roles.values())) / total,
                "idle": cpu["machine_idle"] / total})
    return row


def plain_rows(plain: dict, reference: float) -> tuple[dict, dict]:
    name = f"plain, {plain['threads']} threads"
    throughput = {"table": "throughput", "layout": name, "processes": 1, "torch_threads": plain["threads"],
                  "tokens_per_s": plain["tokens_per_s"], "ratio": plain["tokens_per_s"] / reference,
                  "window_s": plain["window_s"], "step_time_mean_s": plain["step_time"]["mean"],
                  "step_time_std_s": plain["step_time"]["std"],
                  "tokens_per_cpu_s": plain["tokens_per_s"] * plain["window_s"] / plain["cpu_s"]}
    total = plain["machine_busy"] + plain["machine_idle"]
    machine = {"table": "machine", "layout": name, **{c: 0.0 for c in MACHINE_COLUMNS},
               "useful": (plain["cpu_s"] - plain["other_cpu_s"]) / total, "other": plain["other_cpu_s"] / total,
               "other_processes": max(0.0, plain["machine_busy"] - plain["cpu_s"]) / total,
               "idle": plain["machine_idle"] / total}
    throughput["other_processes"] = machine["other_processes"]
    return throughput, machine


# --- the run --------------------------------------------------------------------------------


def run(plan: Plan, result: Result, fast_link: Plan | None = None) -> None:
    from bench.swarm_efficiency.fast_link import run_fast_link
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
    result.summary.update({
        "model": plan.model, "num_parameters": plains[budget]["num_parameters"], "seq_len": plan.seq_len,
        "batch_size": plan.batch_size, "inner_steps": plan.inner_steps, "window_steps": list(plan.window),
        "round_timeout_s": plan.round_timeout_s,
        "plain_threads": budget, "cores": cores, "tokens_per_s_plain": plains[budget]["tokens_per_s"],
        "tokens_per_s_plain_cores": plains[cores]["tokens_per_s"],
        "tokens_per_s": {name: a.throughput["tokens_per_s"] for name, a in analyses.items()},
        "ratio": {name: a.throughput["ratio"] for name, a in analyses.items()},
        "ratio_cores": {name: a.throughput["ratio_cores"] for name, a in analyses.items()},
        "cpu_ratio": {name: a.throughput["cpu_ratio"] for name, a in analyses.items()},
        "other_processes_max": max(row["other_processes"] for row in result.rows if row["table"] == "machine"),
        "daemon_cpu_share": {name: (a.machine["p2pd"] / swarm_cpu[name] if swarm_cpu[name] > 0 else None)
                             for name, a in analyses.items()},
        "step_time_s": {**ana.mean_std(analyses[latency_layout].step_times), "layout": latency_layout},
    })
    result.note("Plain training (in the benchmark process) and every swarm node's compute thread run under cProfile "
                "with a CPU-time timer, so both sides pay its overhead.")
    result.note(f"Steady state: stage-0 inner steps {plan.window[0]}..{plan.window[1]} of {plan.steps}, "
                f"outer rounds every {plan.inner_steps} inner steps (NoLoCo pairs).")


# --- plot and report ------------------------------------------------------------------------

MACHINE_LABELS = {"useful": "useful compute", "recompute": "recompute", "serialisation": "(de)serialisation",
                  "outer": "outer rounds", "other": "other compute", "event_loops": "event loops",
                  "dht": "DHT processes", "p2pd": "p2pd daemons", "driver": "driver + bootstrap",
                  "other_processes": "other processes", "idle": "idle"}
STAGE_LABELS = {**{c: MACHINE_LABELS[c] for c in COMPUTE_COLUMNS}, "wait_for_core": "waiting for a core",
                "idle": "idle (peers, pipeline, rounds, GIL)"}


def _rows(result: dict, table: str) -> list[dict]:
    return [row for row in result["rows"] if row.get("table") == table]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (bars, machine, stages) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1, 1.3, 1.3]})
    throughput = _rows(result, "throughput")
    names = [row["layout"] for row in throughput]
    values = [row["tokens_per_s"] for row in throughput]
    drawn = bars.bar(names, values, color=["0.55" if n.startswith("plain") else "tab:blue" for n in names])
    bars.bar_label(drawn, labels=[f"{row['ratio']:.2f}x\n{_f2(row.get('cpu_ratio'))}x/CPU-s" for row in throughput],
                   fontsize=8)
    bars.set_ylabel("tokens/s (steady state)")
    bars.set_title("tokens/s; labels: ratio to plain, per s and per CPU-s", fontsize=10)
    bars.margins(y=0.15)
    bars.tick_params(axis="x", labelrotation=20)
    _stacked(machine, _rows(result, "machine"), MACHINE_LABELS, "share of the machine's CPU time")
    stage_rows = _rows(result, "stages")
    for row in stage_rows:
        row["label"] = f"{row['layout']} stage {row['stage']}"
    _stacked(stages, stage_rows, STAGE_LABELS, "share of a node's compute thread (wall time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stacked(ax, rows: list[dict], labels: dict[str, str], title: str) -> None:
    from matplotlib import colormaps

    colors = {column: colormaps["tab20"](i) for i, column in enumerate(dict.fromkeys([*MACHINE_LABELS, *STAGE_LABELS]))}
    names = [row.get("label", row["layout"]) for row in rows]
    left = [0.0] * len(rows)
    for column, label in labels.items():
        widths = [row.get(column, 0.0) for row in rows]
        ax.barh(names, widths, left=left, label=label, color=colors[column])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown table lines; ``columns`` = (key, header, format: "pct", "int", "f2", "f3" or "s")."""
    formats = {"pct": _pct, "int": lambda v: f"{v:,.0f}", "f2": lambda v: f"{v:.2f}", "f3": lambda v: f"{v:.3f}",
               "s": str}
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = ["" if row.get(key) is None else formats[fmt](row[key]) for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    from bench.swarm_efficiency.fast_link import fast_link_section

    s = result["summary"]
    parts = ["## Swarm efficiency: a local swarm against plain training", "", _intro(s), "",
             f"```\n{rerun_command(NAME, result['mode'])}\n```", "",
             f"![swarm efficiency](bench/results/{NAME}.png)", "",
             *_tables(result), "", _meaning(result)]
    if _rows(result, "fast_link"):
        parts += ["", *fast_link_section(result)]
    if result.get("notes"):
        parts += ["", *[f"- {note}" for note in result["notes"]]]
    return "\n".join(parts) + "\n"


def _intro(s: dict) -> str:
    layouts = "; ".join(f"**{name}: {s['ratio'][name]:.2f}x** plain's tokens/s ({s['tokens_per_s'][name]:,.0f}), "
                        f"{_f2(s['cpu_ratio'][name])}x its tokens per CPU-second, {s['ratio_cores'][name]:.2f}x "
                        f"plain with {s['cores']} threads" for name in s["ratio"])
    return (f"Model `{s['model']}` ({s['num_parameters']:,} parameters), sequence length {s['seq_len']}, "
            f"{s['batch_size']} sequences per micro-batch and per inner step, NoLoCo with H = {s['inner_steps']}, the "
            f"bundled corpus. Plain training: the whole model in one process with {s['plain_threads']} torch threads "
            f"(what the swarm's nodes have together: `swarm-node local` gives each one), "
            f"{s['tokens_per_s_plain']:,.0f} tokens/s ({s['tokens_per_s_plain_cores']:,.0f} with one thread per core, "
            f"{s['cores']} cores). Swarm in steady state (stage-0 inner steps {s['window_steps'][0]} to "
            f"{s['window_steps'][1]}): {layouts}.")


def _f2(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _tables(result: dict) -> list[str]:
    s = result["summary"]
    return [
        "Throughput in the steady window (`whole run`: `tokens_per_s` of the `swarm-node local` summary, start-up "
        "and final evaluation included; tokens per CPU-second count the CPU time of all the run's processes; "
        "step time: between consecutive inner steps, intervals holding an outer round left out; outer round: "
        "mean time from a node's round start (seeking a partner) to its outer step, in the window; outer rounds "
        "(with a partner) over the whole run; `others`: share of the machine other processes used meanwhile):",
        "",
        *_table(_rows(result, "throughput"), [
            ("layout", "layout", "s"), ("processes", "processes", "int"), ("torch_threads", "torch threads", "int"),
            ("tokens_per_s", "tokens/s", "int"), ("ratio", "ratio to plain", "f2"),
            ("ratio_cores", "ratio to plain, 1 thread/core", "f2"), ("tokens_per_cpu_s", "tokens per CPU-s", "int"),
            ("cpu_ratio", "ratio per CPU-s", "f2"), ("tokens_per_s_whole_run", "tokens/s whole run", "int"),
            ("step_time_mean_s", "step time mean (s)", "f3"), ("step_time_std_s", "step time std (s)", "f3"),
            ("round_time_mean_s", "outer round (s)", "f2"), ("outer_rounds", "outer rounds", "int"),
            ("rounds_with_partner", "with partner", "int"),
            ("microbatches_lost", "micro-batches lost", "int"), ("other_processes", "others", "pct")]),
        "",
        "Where the machine's CPU time goes in the steady window (all cores together; the compute buckets split each "
        "node's compute-thread CPU time, read from /proc, by that thread's cProfile):",
        "",
        *_table(_rows(result, "machine"),
                [("layout", "layout", "s"), *[(c, MACHINE_LABELS[c], "pct") for c in MACHINE_COLUMNS]]),
        "",
        "Per stage: one node's compute thread over the window (mean over the stage's nodes; runnable but without a "
        "core is `waiting for a core`, blocked is `idle`), and the CPU its other threads and processes use, in cores:",
        "",
        *_table(_rows(result, "stages"), [
            ("layout", "layout", "s"), ("stage", "stage", "int"), *[(c, STAGE_LABELS[c], "pct") for c in STAGE_LABELS],
            ("event_loop_cores", "event loop", "f2"), ("dht_cores", "DHT process", "f2"),
            ("p2pd_cores", "p2pd", "f2")]),
        "",
        "p2pd's share of the swarm's own CPU time: "
        + ", ".join(f"{name} {_pct(v)}" for name, v in s["daemon_cpu_share"].items())
        + f". Inner-step time of the {s['step_time_s']['layout']} swarm's nodes (`summary.step_time_s`, read by the "
        f"latency-model benchmark): mean {s['step_time_s']['mean']:.3f} s, std {s['step_time_s']['std']:.3f} s over "
        f"{s['step_time_s']['n']} steps.",
    ]


def _meaning(result: dict) -> str:
    s = result["summary"]
    machine = {row["layout"]: row for row in _rows(result, "machine")}
    plain_useful = next(row["useful"] for name, row in machine.items() if name.startswith("plain"))
    idle = {}
    for row in _rows(result, "stages"):
        idle.setdefault(row["layout"], []).append(row["idle"])
    sentences = []
    for name, ratio in s["ratio"].items():
        m = machine[name]
        network = m["event_loops"] + m["dht"] + m["p2pd"] + m["driver"]
        verdict = "falls short of plain training by" if ratio < 1 else "beats plain training by"
        sentences.append(
            f"The {name} swarm {verdict} {_pct(abs(1 - ratio))} in tokens/s ({_f2(s['cpu_ratio'][name])}x per "
            f"CPU-second). Useful compute, the work plain training also does, gets {_pct(m['useful'])} of the "
            f"machine against {_pct(plain_useful)} in plain training; the rest goes to recomputation "
            f"({_pct(m['recompute'])}), (de)serialisation ({_pct(m['serialisation'])}), outer rounds "
            f"({_pct(m['outer'])}), the networking stack (event loops, DHT processes, p2pd, driver: {_pct(network)}, "
            f"p2pd alone {_pct(m['p2pd'])}) and idle cores ({_pct(m['idle'])}); a compute thread is blocked "
            f"(waiting for peers, the pipeline, a round partner, or the GIL) {_pct(sum(idle[name]) / len(idle[name]))} "
            "of the time on average.")
    for row in _rows(result, "throughput"):
        if row.get("outer_rounds") and row["rounds_with_partner"] < row["outer_rounds"]:
            sentences.append(
                f"In {row['layout']} only {row['rounds_with_partner']} of {row['outer_rounds']} outer rounds found "
                f"a partner: a node seeks one for up to {s['round_timeout_s']:.0f} s before its local-only step, and "
                f"rounds took {_f2(row['round_time_mean_s'])} s on average, during which its stage does not train.")
    sentences.append(
        "Recomputation is the price of the pipeline without stored activations (each non-last stage runs its "
        "forward twice, about a third of its useful work); the one-stage layout has none and pays only for outer "
        "rounds and a networking stack per process, which on a machine this small competes with compute for the "
        "same cores.")
    if s["other_processes_max"] > 0.05:
        sentences.append(
            f"Other processes used up to {_pct(s['other_processes_max'])} of the machine during these measurements: "
            "tokens/s ratios then also depend on how the scheduler shared the cores between one plain process and "
            "the swarm's many, while the ratio per CPU-second does not; rerun on an idle machine for clean tokens/s.")
        if s["tokens_per_s_plain_cores"] < 0.5 * s["tokens_per_s_plain"]:
            sentences.append(
                f"Plain training with {s['cores']} threads suffers most from that load: with as many threads as "
                "cores, libgomp spin-waits at its barriers while the other thread is descheduled (with "
                f"{s['plain_threads']} threads it sees the oversubscription and spins briefly; "
                "`OMP_WAIT_POLICY=PASSIVE` also avoids it).")
    return "What it means: " + " ".join(sentences)


def main(argv: list[str] | None = None) -> int:
    args = parse_mode(__doc__.splitlines()[0], argv)
    from bench.swarm_efficiency.fast_link import FAST_LINK_FULL, FAST_LINK_QUICK

    plan, fast = (FULL, FAST_LINK_FULL) if args.full else (QUICK, FAST_LINK_QUICK)
    result = Result(NAME, args.mode, args.out_dir)
    run(plan, result, fast)
    path = result.write()
    plot(json.loads(path.read_text()), result.path(".png"))
    return 0
