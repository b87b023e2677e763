"""Instruments for the swarm-efficiency benchmark: a ``swarm-node local`` whose nodes
record their progress and profile themselves, and a sampler of per-thread CPU time.

``python -m bench.swarm_efficiency.probe local ARGS`` is ``swarm-node local ARGS``,
except that it starts each node as ``python -m bench.swarm_efficiency.probe join ...``
instead of ``python -m swarm_node join ...`` (the library has no hook for the node
command, so the driver's view of ``subprocess`` is wrapped), and evaluates the final
weights on one batch of 8 windows instead of 8 of 64: evaluation comes after the
measured window, and at full size it would take as long as the training (the summary's
``final_val_loss`` is then only a sanity check). Such a node is the real node plus, when
``$SWARM_EFFICIENCY_PROBE_DIR`` is set:

* a ``time.monotonic()`` stamp at every inner step, every micro-batch whose gradient
  is accumulated (with its sample count), and the start and end of every outer round;
* a cProfile with a CPU-time timer of its compute thread (where all its torch work and
  (de)serialisation run), from its inner step A to its inner step B
  (``$SWARM_EFFICIENCY_PROFILE_STEPS=A:B``, or up to shutdown if it stops earlier);

written at shutdown as ``node-<pid>.json`` and ``node-<pid>-compute.prof`` in that
directory. Nothing else about the node changes."""

from __future__ import annotations

import cProfile
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.swarm_efficiency.analysis import Sample, TaskStat, parse_cpu_line, parse_schedstat, parse_stat

PROBE_DIR_ENV = "SWARM_EFFICIENCY_PROBE_DIR"
PROFILE_STEPS_ENV = "SWARM_EFFICIENCY_PROFILE_STEPS"
MODULE = "bench.swarm_efficiency.probe"


# --- the node side --------------------------------------------------------------------


class NodeProbe:
    """Timestamps and profiles of one node process (see the module docstring)."""

    def __init__(self, out_dir: Path, first_step: int, last_step: int):
        self.out_dir = out_dir
        self.first_step, self.last_step = first_step, last_step
        self.step_times: list[float] = []
        self.sample_times: list[float] = []
        self.samples: list[int] = []
        self.rounds: list[list[float]] = []
        self.compute_tid: int | None = None
        self.compute_profile = cProfile.Profile(time.thread_time)
        self.profiling = False
        self.profiled_steps: list[int] = []

    def install(self) -> None:
        """Times the worker's steps, micro-batches and rounds (every node of this process)."""
        from swarm_node.train.worker import StageWorker

        probe = self
        step, accumulated = StageWorker.step, StageWorker._accumulated
        open_round, close_round = StageWorker.open_round, StageWorker.close_round

        def timed_step(worker):
            count = step(worker)
            probe.on_step(count)
            return count

        def timed_accumulated(worker, samples):
            accumulated(worker, samples)
            probe.sample_times.append(time.monotonic())
            probe.samples.append(samples)

        def timed_open_round(worker, overlapped=False):
            probe.rounds.append([time.monotonic(), float("nan")])
            return open_round(worker, overlapped)

        def timed_close_round(worker, others):
            close_round(worker, others)
            if probe.rounds:
                probe.rounds[-1][1] = time.monotonic()

        StageWorker.step, StageWorker._accumulated = timed_step, timed_accumulated
        StageWorker.open_round, StageWorker.close_round = timed_open_round, timed_close_round

    def attach(self, node) -> None:
        """Write the report when ``node`` shuts down (through its public shutdown hook)."""
        node.before_shutdown.append(lambda: self.finish(node))

    def on_step(self, count: int) -> None:
        """On the compute thread, right after inner step ``count``."""
        self.step_times.append(time.monotonic())
        self.compute_tid = threading.get_native_id()
        if count == self.first_step and not self.profiling:
            self.profiling = True
            self.profiled_steps = [count, count]
            self.compute_profile.enable()  # cProfile hooks the calling thread only
        elif count == self.last_step and self.profiling:
            self._stop_profile(count)

    def _stop_profile(self, count: int) -> None:
        self.compute_profile.disable()
        self.profiling = False
        self.profiled_steps[1] = count

    async def finish(self, node) -> None:
        """On the event loop at the start of the node's shutdown: stop profiling (on the
        compute thread, the one profiled) and write what was recorded."""
        if node.worker is None:
            return
        if self.profiling:
            await node.compute(self._stop_profile, node.worker.inner_step)
        pid = os.getpid()
        self.compute_profile.dump_stats(str(self.out_dir / f"node-{pid}-compute.prof"))
        record = {"pid": pid, "stage": node.stage, "peer_id": node.peer_id, "compute_tid": self.compute_tid,
                  "step_times": self.step_times, "sample_times": self.sample_times, "samples": self.samples,
                  "rounds": self.rounds, "profiled_steps": self.profiled_steps}
        (self.out_dir / f"node-{pid}.json").write_text(json.dumps(record))


def _node_probe() -> NodeProbe | None:
    out_dir = os.environ.get(PROBE_DIR_ENV)
    if not out_dir:
        return None
    first, _, last = os.environ.get(PROFILE_STEPS_ENV, "1:1000000").partition(":")
    probe = NodeProbe(Path(out_dir), int(first), int(last))
    probe.install()
    return probe


# --- the driver side -----------------------------------------------------------------


class _SubprocessForDriver:
    """``subprocess`` as swarm_node.local sees it: node commands start this module."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, **kwargs):
        if list(cmd[1:4]) == ["-m", "swarm_node", "join"]:
            cmd = [cmd[0], "-m", MODULE, *cmd[3:]]
        return subprocess.Popen(cmd, *args, **kwargs)


def _install_driver_shim() -> None:
    import swarm_node.local.swarm

    @dataclass(frozen=True)
    class SmallEvaluation(swarm_node.local.swarm.LocalConfig):
        eval_batches: int = 1
        eval_batch_size: int = 8

    swarm_node.local.swarm.subprocess = _SubprocessForDriver()
    swarm_node.local.swarm.LocalConfig = SmallEvaluation  # what cli/local.py builds the driver's config from


def main(argv: list[str]) -> int:
    from swarm_node.cli.main import main as swarm_node_main

    if argv[:1] == ["local"]:
        _install_driver_shim()
    elif argv[:1] == ["join"] and (probe := _node_probe()) is not None:
        return swarm_node_main(argv, on_node=probe.attach)
    return swarm_node_main(argv)


# --- CPU sampling --------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # the process or thread ended between listing and reading


def _process_tree(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) for ``root`` and all its descendants."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            text = _read(f"/proc/{entry}/stat")
            if text is not None:
                comm, ppid = parse_stat(text)
                table[int(entry)] = (ppid, comm)
    tree, frontier = {}, [root]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        pid = frontier.pop()
        if pid in table:
            tree[pid] = table[pid]
            frontier.extend(children.get(pid, []))
    return tree


def sample_tree(root: int, ticks_per_s: float) -> Sample:
    """One sample of every thread of ``root``'s process tree and of the machine's CPUs."""
    tasks = {}
    for pid, (ppid, comm) in _process_tree(root).items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            sched = _read(f"/proc/{pid}/task/{tid}/schedstat")
            if sched is not None:
                cpu_s, wait_s = parse_schedstat(sched)
                tasks[int(tid)] = TaskStat(pid, ppid, comm, cpu_s, wait_s)
    busy, idle = parse_cpu_line(_read("/proc/stat").splitlines()[0], ticks_per_s)
    return Sample(time.monotonic(), busy, idle, tasks)


class TreeSampler:
    """Samples a process tree every ``period_s`` on a thread, until stopped."""

    def __init__(self, root: int, period_s: float = 0.5):
        self.root = root
        self.period_s = period_s
        self.samples: list[Sample] = []
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(sample_tree(self.root, self._ticks_per_s))
            self._stop.wait(self.period_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
