"""The measuring side of the swarm-efficiency benchmark (bench/swarm_efficiency/benchmark.py
says what it measures): plain training in this process, a probed ``swarm-node local``
run with its process tree sampled, and each layout's analysis of the steady window."""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import ROOT as REPO
from bench.swarm_efficiency import analysis as ana
from bench.swarm_efficiency.probe import MODULE as PROBE_MODULE
from bench.swarm_efficiency.probe import PROBE_DIR_ENV, PROFILE_STEPS_ENV, TreeSampler


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
        """The run spec ``swarm-node local`` builds from the same flags (cli/local.py)."""
        from swarm_node.config import default_warmup_steps, suggested_lr
        from swarm_node.data.spec import DataSpec
        from swarm_node.optim import InnerHyper, default_method
        from swarm_node.spec import RunSpec

        return RunSpec(run_id="bench-plain", model_size=self.model, num_stages=num_stages,
                       seq_len=self.seq_len, batch_size=self.batch_size, samples_per_step=self.batch_size,
                       total_steps=self.steps, data=DataSpec.parse(self.data),
                       method=default_method("noloco", inner_steps=self.inner_steps),
                       inner=InnerHyper(lr=suggested_lr(self.model),
                                        warmup_steps=default_warmup_steps(self.steps),
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
    from swarm_node.data.sharded_batches import ShardedBatches
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
           "--batch-size", str(plan.batch_size), "--steps", str(plan.steps), "--inner-steps",
           str(plan.inner_steps),
           "--round-timeout", str(plan.round_timeout_s),
           "--run-dir", str(probe_dir / "run"), "--json-out", str(summary_path), "--no-progress",
           *([] if lanes else ["--no-lanes"])]
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
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
        children = {
            task.pid for sample in samples for task in sample.tasks.values() if task.ppid == driver.pid
        }
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
    stages = [
        _stage_row(
            name,
            stage,
            cpu["stages"].get(stage, {}),
            stage_shares[stage],
            sum(n["stage"] == stage for n in run.nodes) * window,
        )
        for stage in sorted(stage_shares)
    ]
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


def _stage_row(layout: str, stage: int, cpu: dict[str, float], shares: dict[str, float],
               node_seconds: float) -> dict:
    """Fractions of one node's window (mean over the stage's nodes): its compute thread's
    buckets, runqueue wait and idle time, and its other processes' CPU in cores."""
    busy = cpu.get("compute", 0.0) / node_seconds
    wait = cpu.get("compute_wait", 0.0) / node_seconds
    row = {"table": "stages", "layout": layout, "stage": stage}
    row.update({column: busy * shares[column] for column in COMPUTE_COLUMNS})
    row.update({"wait_for_core": wait, "idle": max(0.0, 1.0 - busy - wait),
                "event_loop_cores": cpu.get("event_loop", 0.0) / node_seconds,
                "dht_cores": cpu.get("dht", 0.0) / node_seconds,
                "p2pd_cores": cpu.get("p2pd", 0.0) / node_seconds})
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
               "useful": (plain["cpu_s"] - plain["other_cpu_s"]) / total,
               "other": plain["other_cpu_s"] / total,
               "other_processes": max(0.0, plain["machine_busy"] - plain["cpu_s"]) / total,
               "idle": plain["machine_idle"] / total}
    throughput["other_processes"] = machine["other_processes"]
    return throughput, machine
