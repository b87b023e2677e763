"""The arithmetic of the swarm-efficiency benchmark, kept free of processes and I/O so it
can be unit-tested: steady-state rates from event timestamps, inner-step time
statistics, attribution of a cProfile of a node's compute thread to buckets, and the
CPU accounting of a process tree sampled from /proc.

Times are ``time.monotonic()`` seconds (one clock for every process of the machine);
CPU times are seconds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# --- steady state -------------------------------------------------------------------


def steady_window(step_times: Sequence[Sequence[float]], first_step: int, last_step: int) -> tuple[float,
                                                                                                   float]:
    """The interval in which every node of ``step_times`` (one list of inner-step
    timestamps per stage-0 node) is between its inner steps ``first_step`` and
    ``last_step`` (1-based): from the last node to reach the first to the first node to
    reach the last. Start-up and the end of the run lie outside."""
    if not step_times or any(len(times) < last_step for times in step_times):
        raise ValueError(f"every node needs at least {last_step} inner steps")
    start = max(times[first_step - 1] for times in step_times)
    end = min(times[last_step - 1] for times in step_times)
    if end <= start:
        raise ValueError("the nodes' step windows do not overlap; run more steps")
    return start, end


def count_between(times: Sequence[float], amounts: Sequence[float], start: float, end: float) -> float:
    """How much of ``amounts`` (one per event at ``times``) accrued in [start, end],
    interpolating the cumulative sum linearly between events."""
    if len(times) == 0:
        return 0.0
    t = np.asarray(times, dtype=float)
    cumulative = np.cumsum(np.asarray(amounts, dtype=float))
    at = np.interp([start, end], t, cumulative, left=0.0)
    return float(at[1] - at[0])


def interval_stats(step_times: Sequence[float], rounds: Sequence[Sequence[float]], start: float,
                   end: float) -> list[float]:
    """Times between consecutive inner steps inside [start, end], leaving out intervals
    during which an outer round (start, end) ran: those measure the round, not a step."""
    out = []
    for before, after in zip(step_times, step_times[1:]):
        if before < start or after > end:
            continue
        if any(r_start < after and r_end > before for r_start, r_end in rounds):
            continue
        out.append(after - before)
    return out


def mean_std(values: Iterable[float]) -> dict:
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": float(data.mean()), "std": float(data.std(ddof=1)) if data.size > 1 else 0.0,
            "n": int(data.size)}


# --- the compute thread's profile --------------------------------------------------

# A function as pstats names it: (end of the file path, function name).
Func = tuple[str, str]

WORKER = "swarm_node/train/worker.py"
CODEC = "swarm_node/wire/frames.py"
CHECK = "swarm_node/gossip/partner_check.py"
MODULE_CALL: Func = ("torch/nn/modules/module.py", "_wrapped_call_impl")

# The work plain training does too: forward, backward, the inner optimizer step.
USEFUL: tuple[Func, ...] = ((WORKER, "forward"), (WORKER, "backward"), (WORKER, "forward_backward_last"),
                            (WORKER, "step"))
SERIALISATION: tuple[Func, ...] = ((CODEC, "encode_frame"), (CODEC, "decode_frame"))
OUTER: tuple[Func, ...] = ((WORKER, "open_round"), (WORKER, "close_round"), (CHECK, "check"),
                           (CHECK, "note_own_delta"), (CHECK, "norm"))
# The executor's idle wait for the next work item (no CPU with a CPU-time timer, but
# excluded by name so that a wall-clock profile reads the same).
IDLE_WAIT = ("~", "<method 'get' of '_queue.SimpleQueue' objects>")

BUCKETS = ("useful", "recompute", "serialisation", "outer", "other")


def _keys(stats: dict, func: Func) -> list[tuple]:
    suffix, name = func
    return [key for key in stats if key[2] == name and key[0].endswith(suffix)]


def _cumulative(stats: dict, funcs: Sequence[Func]) -> float:
    """Cumulative time of ``funcs``, not counting twice a call of one of them made by
    another of them."""
    keys = {key for func in funcs for key in _keys(stats, func)}
    total = sum(stats[key][3] for key in keys)
    nested = sum(edge[3] for key in keys for caller, edge in stats[key][4].items() if caller in keys)
    return total - nested


def recompute_time(stats: dict) -> float:
    """Time of the module forward that ``StageWorker.backward`` re-runs (recomputation)."""
    backward = set(_keys(stats, (WORKER, "backward")))
    return sum(edge[3] for key in _keys(stats, MODULE_CALL) for caller, edge in stats[key][4].items()
               if caller in backward)


def compute_buckets(stats: dict) -> dict[str, float]:
    """Seconds of the profiled thread per bucket (``pstats.Stats(...).stats`` format:
    key (file, line, name) -> (calls, primitive calls, own time, cumulative time,
    callers {key: the same four numbers for that edge})). ``other`` is the rest of the
    thread's busy time: validation of what peers send, batch loading, executor overhead."""
    recompute = recompute_time(stats)
    buckets = {"useful": _cumulative(stats, USEFUL) - recompute, "recompute": recompute,
               "serialisation": _cumulative(stats, SERIALISATION), "outer": _cumulative(stats, OUTER)}
    busy = sum(entry[2] for key, entry in stats.items() if (key[0], key[2]) != IDLE_WAIT)
    buckets["other"] = max(0.0, busy - sum(buckets.values()))
    return buckets


def shares(buckets: dict[str, float]) -> dict[str, float]:
    total = sum(buckets.values())
    return {name: (value / total if total > 0 else 0.0) for name, value in buckets.items()}


# --- /proc ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskStat:
    """One thread at one sample: its process, the process's parent and name, and the
    thread's CPU time and time spent runnable but waiting for a core (seconds)."""
    pid: int
    ppid: int
    comm: str
    cpu_s: float
    wait_s: float


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, ppid) from a /proc/<pid>/stat line; comm may hold spaces and parentheses."""
    head, _, tail = text.rpartition(")")
    return head.partition("(")[2], int(tail.split()[1])


def parse_schedstat(text: str) -> tuple[float, float]:
    """(CPU seconds, runqueue-wait seconds) from /proc/<pid>/task/<tid>/schedstat."""
    cpu_ns, wait_ns, _ = text.split()
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def parse_cpu_line(text: str, ticks_per_s: float) -> tuple[float, float]:
    """(busy seconds, idle seconds) summed over all CPUs from the first line of /proc/stat.
    Steal time (the hypervisor ran someone else) counts as busy: it is not ours to use."""
    values = [int(v) for v in text.split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / ticks_per_s, idle / ticks_per_s


@dataclass(frozen=True)
class Sample:
    t: float
    machine_busy_s: float
    machine_idle_s: float
    tasks: dict[int, TaskStat]  # by thread id


def task_delta(samples: Sequence[Sample], tid: int, start: float, end: float) -> tuple[float, float]:
    """(CPU seconds, runqueue-wait seconds) thread ``tid`` accrued in [start, end]; a
    thread born or gone inside the window counts from zero or up to its last sample."""
    seen = [(s.t, s.tasks[tid]) for s in samples if tid in s.tasks]
    if not seen:
        return 0.0, 0.0
    times = [t for t, _ in seen]

    def grown(values: list[float]) -> float:
        at = np.interp([start, end], times, values, left=0.0)
        return float(at[1] - at[0])

    return grown([task.cpu_s for _, task in seen]), grown([task.wait_s for _, task in seen])


def machine_delta(samples: Sequence[Sample], start: float, end: float) -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine in [start, end]."""
    times = [s.t for s in samples]
    busy = np.interp([start, end], times, [s.machine_busy_s for s in samples])
    idle = np.interp([start, end], times, [s.machine_idle_s for s in samples])
    return float(busy[1] - busy[0]), float(idle[1] - idle[0])


@dataclass(frozen=True)
class NodeThreads:
    """What the benchmark knows of one node process: its stage and compute thread."""
    pid: int
    stage: int
    compute_tid: int


def _owner(pid: int, parents: dict[int, int], nodes: dict[int, NodeThreads]) -> NodeThreads | None:
    """The node process ``pid`` belongs to (itself or an ancestor), if any."""
    seen = set()
    while pid not in nodes and pid in parents and pid not in seen:
        seen.add(pid)
        pid = parents[pid]
    return nodes.get(pid)


def classify(task: TaskStat, tid: int, parents: dict[int, int],
             nodes: dict[int, NodeThreads]) -> tuple[str, int | None]:
    """(role, stage or None) of one thread of the swarm's process tree: a node's compute
    thread or its other threads (event loop, hivemind's helpers), the DHT process hivemind
    forks from each node, a p2pd daemon, or the ``swarm-node local`` driver with its own
    bootstrap DHT (no stage)."""
    owner = _owner(task.pid, parents, nodes)
    stage = owner.stage if owner is not None else None
    if task.comm == "p2pd":
        return "p2pd", stage
    if task.pid in nodes:
        return ("compute" if tid == owner.compute_tid else "event_loop"), stage
    return ("dht" if owner is not None else "driver"), stage


def cpu_accounting(samples: Sequence[Sample], nodes: dict[int, NodeThreads], start: float,
                   end: float) -> dict:
    """CPU seconds in [start, end] of every thread of the sampled tree, by role and by
    stage: ``{"roles": {role: s}, "stages": {stage: {role: s}}, "machine_busy": s,
    "machine_idle": s}``; per stage also ``compute_wait``, the compute threads' time
    runnable but waiting for a core."""
    parents = {task.pid: task.ppid for sample in samples for task in sample.tasks.values()}
    tids = {tid: task for sample in samples for tid, task in sample.tasks.items()}
    roles: dict[str, float] = {}
    stages: dict[int, dict[str, float]] = {}
    for tid, task in tids.items():
        role, stage = classify(task, tid, parents, nodes)
        cpu, wait = task_delta(samples, tid, start, end)
        roles[role] = roles.get(role, 0.0) + cpu
        if stage is not None:
            per_stage = stages.setdefault(stage, {})
            per_stage[role] = per_stage.get(role, 0.0) + cpu
            if role == "compute":
                per_stage["compute_wait"] = per_stage.get("compute_wait", 0.0) + wait
    busy, idle = machine_delta(samples, start, end)
    return {"roles": roles, "stages": stages, "machine_busy": busy, "machine_idle": idle}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator or not math.isfinite(denominator):
        return None
    return numerator / denominator
