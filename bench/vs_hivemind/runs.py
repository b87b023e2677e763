"""Running the two swarms of bench.vs_hivemind side by side in the same way: each in a
sandbox of its own (bench/common/sandbox.py), its loopback byte counter sampled while
it trains, and its peers' weights kept along the way as snapshots on disk
(``snap-r<replica>-<step>.pt`` holding step, wall time and the model's state dict)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common.procs import ChildFailed, spawn, stop, wait_all
from bench.common.sandbox import Sandbox
from bench.common.snapshots import CheckpointCopier
from bench.common.snapshots import load_snapshots as load_run_snapshots

TICK_S = 0.2  # how often the watchers look; a checkpoint lives for at least one round
NODE_READY = "others can join through this node"  # a swarm-node node's last line before training


@dataclass(frozen=True)
class Plan:
    peers: int
    model: str
    steps: int
    inner_steps: int = 50  # H: NoLoCo's default; hivemind averages once per as many local steps
    batch_size: int = 8
    seq_len: int = 64
    seed: int = 0
    data: str = "corpus"
    lr: float | None = None  # None: the project's suggested lr for the model
    hivemind_modes: tuple[str, ...] = ("local-updates",)
    matchmaking_s: float = 3.0  # hivemind's docs: 3-5 s for small local runs
    averaging_timeout_s: float = 10.0  # its docs: about 2x an all-reduce, which takes 3-4 s here
    time_limit_s: float = 120.0  # per swarm, start-up included

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class SwarmRun:
    method: str
    snapshot_dir: Path
    launched: float  # time.time() when the first process was started
    wall_s: float = 0.0
    tx_samples: list[tuple[float, float]] = field(default_factory=list)  # (s since launch, loopback bytes)
    training_started_s: float | None = None  # the last peer's start of training, since launch
    incomplete: str | None = None  # why the run was stopped before every peer finished
    info: dict = field(default_factory=dict)


class _Counter:
    """Samples the sandbox's loopback byte counter (nothing without a sandbox)."""

    def __init__(self, box: Sandbox | None, run: SwarmRun):
        self.box, self.run = box, run
        self.start = box.tx_bytes() if box else None

    def sample(self) -> None:
        if self.box is not None:
            self.run.tx_samples.append((time.time() - self.run.launched, self.box.tx_bytes() - self.start))


def _in_box(box: Sandbox | None, cmd: list[str]) -> list[str]:
    return box.command(cmd) if box else cmd


def _watch(processes: Sequence, deadline: float, on_tick: Callable[[], None]) -> None:
    while any(p.poll() is None for p in processes):
        if time.monotonic() > deadline:
            raise ChildFailed("the swarm ran past its time limit")
        on_tick()
        time.sleep(TICK_S)
    on_tick()


# -- hivemind.Optimizer ------------------------------------------------------------------
def _peer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.vs_hivemind.peer", *args]


def run_hivemind(plan: Plan, mode: str, work: Path, box: Sandbox | None, lr: float) -> SwarmRun:
    out = work / f"hivemind-{mode}"
    out.mkdir(parents=True)
    maddr_file = out / "bootstrap.maddrs"
    run = SwarmRun(f"hivemind {mode}", out, time.time())
    counter = _Counter(box, run)
    deadline = time.monotonic() + plan.time_limit_s
    procs = [spawn(_in_box(box, _peer_cmd("bootstrap", "--maddr-file", str(maddr_file))),
                   out / "bootstrap.log")]
    try:
        logs = [out / f"peer-{rank}.log" for rank in range(plan.peers)]
        peers = [spawn(_in_box(box, _peer_cmd(
            "train", "--maddr-file", str(maddr_file), "--out-dir", str(out), "--rank", str(rank),
            "--peers", str(plan.peers), "--mode", mode, "--model", plan.model, "--data", plan.data,
            "--seq-len", str(plan.seq_len), "--batch-size", str(plan.batch_size), "--steps", str(plan.steps),
            "--inner-steps", str(plan.inner_steps), "--lr", str(lr), "--seed", str(plan.seed),
            "--matchmaking-s", str(plan.matchmaking_s), "--averaging-timeout-s",
            str(plan.averaging_timeout_s))),
            log) for rank, log in enumerate(logs)]
        procs += peers
        try:
            _watch(peers, deadline, counter.sample)
            wait_all(peers, logs, deadline)
        except ChildFailed as exc:  # a stalled or failed peer: keep what the swarm trained until then
            run.incomplete = str(exc).splitlines()[0]
        run.wall_s = time.time() - run.launched
    finally:
        for process in reversed(procs):
            stop(process, grace_s=10.0)
    starts = sorted(out.glob("snap-r*-0000000.pt"))  # written when a peer starts training
    if len(starts) == plan.peers:
        run.training_started_s = max(torch.load(p)["time"] for p in starts) - run.launched
    last_steps = {}
    for path in out.glob("snap-r*-*.pt"):
        replica, step = path.stem.split("-")[1:]
        last_steps[replica] = max(last_steps.get(replica, 0), int(step))
    run.info = {"tokens": sum(last_steps.values()) * plan.tokens_per_step, **_averaging_counts(logs)}
    return run


def _averaging_counts(logs: Sequence[Path]) -> dict:
    """What hivemind's verbose log says happened, summed over peers."""
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    return {"averaged_rounds": len(re.findall(r"Averaged (?:parameters|gradients) with \d+ peers", text)),
            "failed_rounds": len(re.findall(r"Averaging (?:gradients )?failed", text)),
            "state_downloads": text.count("Peer is out of sync")}


# -- swarm-node local ----------------------------------------------------------------------
class _NodeWatcher(CheckpointCopier):
    """Also notes when each node's log says it starts training."""

    def __init__(self, run_dir: Path, run: SwarmRun, param_names: list[str], peers: int):
        super().__init__({r: run_dir / f"checkpoints-s0-r{r}" for r in range(peers)}, run.snapshot_dir,
                         param_names)
        self.run_dir, self.run = run_dir, run
        self.ready: dict[str, float] = {}

    def tick(self) -> None:
        super().tick()
        for log in self.run_dir.glob("node-s0-r*.log"):
            if log.name not in self.ready and NODE_READY in log.read_text(errors="replace"):
                self.ready[log.name] = time.time() - self.run.launched


def run_swarm_node(plan: Plan, work: Path, box: Sandbox | None, param_names: list[str]) -> SwarmRun:
    out = work / "swarm-node"
    run_dir = out / "run"
    out.mkdir(parents=True)
    summary_path = out / "summary.json"
    cmd = [sys.executable, "-m", "bench.vs_hivemind.swarm", "--replicas", str(plan.peers), "--model",
           plan.model,
           "--data", plan.data, "--seq-len", str(plan.seq_len), "--batch-size", str(plan.batch_size),
           "--steps", str(plan.steps), "--inner-steps", str(plan.inner_steps), "--seed", str(plan.seed),
           "--run-dir", str(run_dir), "--json-out", str(summary_path)]
    if plan.lr is not None:
        cmd += ["--lr", str(plan.lr)]
    run = SwarmRun("swarm-node noloco", out, time.time())
    counter = _Counter(box, run)
    copier = _NodeWatcher(run_dir, run, param_names, plan.peers)
    # twice the limit: after training it evaluates and stops its nodes itself, which the
    # hivemind harness leaves to us
    deadline = time.monotonic() + 2 * plan.time_limit_s
    process = spawn(_in_box(box, cmd), out / "local.log")
    try:
        _watch([process], deadline, lambda: (counter.sample(), copier.tick()))
        wait_all([process], [out / "local.log"], deadline)
        run.wall_s = time.time() - run.launched
    finally:
        stop(process, grace_s=40.0)  # it stops its nodes itself, within its own 30 s grace
    summary = json.loads(summary_path.read_text())
    run.training_started_s = max(copier.ready.values()) if len(copier.ready) == plan.peers else None
    run.info = {"tokens": summary["tokens"], "summary_final_val_loss": summary["final_val_loss"],
                "consensus_val_loss": summary["final_consensus_val_loss"],
                "app_bytes_sent": [p["bytes_sent"] for p in summary["peers"]],
                "rounds_with_partner": [p["rounds_with_partner"] for p in summary["peers"]],
                "local_only_rounds": [p["local_only_rounds"] for p in summary["peers"]]}
    return run


def load_snapshots(run: SwarmRun) -> list[dict]:
    """Every snapshot of a run, oldest first (bench/common/snapshots.py)."""
    return load_run_snapshots(run.snapshot_dir, run.launched)
