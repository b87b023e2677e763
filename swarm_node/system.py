"""Operating-system resources a long-running peer needs."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

WANTED_OPEN_FILES = 65_536
MIN_OPEN_FILES = 4_096  # each peer connection costs the daemon a few descriptors
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
# per-CPU clock ticks: "cpuN user nice system idle iowait irq softirq steal ..."
PROC_STAT = Path("/proc/stat")


def run_on_fast_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a uvloop loop: uvloop is a dependency, but the programs run
    on plain asyncio too. A loop factory, not ``uvloop.install()``, which sets a global
    policy and is deprecated from Python 3.12."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> int:
    """Raise the soft open-file limit towards ``wanted`` (the libp2p daemon, a child
    process, inherits it); warn when the hard limit keeps it low. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-file limit: %s", exc)
    if soft < MIN_OPEN_FILES:
        log.warning("open-file limit is %d; a peer with many connections needs more: raise it "
                    "(`ulimit -n %d`, or LimitNOFILE=%d in a systemd unit)", soft, WANTED_OPEN_FILES,
                    WANTED_OPEN_FILES)
    return soft


def _cgroup_cpu_quota() -> float | None:
    """A cgroup v2 CPU quota in cores (a container limited to 1.5 CPUs still sees every
    host core in its affinity mask), or None."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks so far of ``cpus``, from /proc/stat."""
    busy = total = 0
    try:
        for line in PROC_STAT.read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def busy_cores(cpus: set[int], window_s: float = 0.5) -> float:
    """How many of ``cpus`` other processes keep busy now: their non-idle share over a
    short window. Not the load average: it lags a minute behind, both a load that just
    began and one that just ended."""
    before = _cpu_times(cpus)
    time.sleep(window_s)  # measuring a rate, not waiting for anything
    after = _cpu_times(cpus)
    if before is None or after is None or after[1] <= before[1]:
        return min(float(len(cpus)), os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def _allowed_cpus() -> set[int]:
    """The CPUs in this process's affinity mask (every CPU where there is no mask to read)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def usable_cores() -> float:
    """Cores this process may run on, busy or not: its affinity mask, capped by a cgroup
    CPU quota."""
    cpus, quota = len(_allowed_cpus()), _cgroup_cpu_quota()
    return cpus if quota is None else min(cpus, quota)


def free_cores(window_s: float = 0.5) -> float:
    """Cores this process could use without taking them from another: the idle share of
    the CPUs in its affinity mask, capped by a cgroup CPU quota."""
    cpus = _allowed_cpus()
    free = len(cpus) - busy_cores(cpus, window_s)
    quota = _cgroup_cpu_quota()
    return free if quota is None else min(free, quota)


def default_threads() -> int:
    """Torch CPU threads for a process that should use the cores nobody else is using: the
    free cores (a core counts when at least 80 % of it is idle), at least one. Erring low
    is cheap and erring high is not: OpenMP threads outnumbering the free cores spin,
    waiting for each other at every operation while preempted (on a busy 2-core
    machine, 2 threads run at about half the speed of 1)."""
    return max(1, int(free_cores() + 0.2))


def node_threads() -> int:
    """Torch threads of a training node: OMP_NUM_THREADS when set, else the free cores
    less one, which the node's event loop, DHT process and libp2p daemon need."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, default_threads() - 1)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str | Callable[[BinaryIO], object], *, mode: int = 0o644,
                 durable: bool = False) -> None:
    """``path`` holds the old bytes or the new ones, never half of them: written beside it,
    then renamed over it. ``data`` may be a function that writes into the open file (a
    simulator of 450 MB pickled straight to disk, not held twice in memory). ``durable``: on the disk
    before this returns (a resumable preparation must not find a renamed file that a power
    cut emptied). The staging file has a name of its own in each call, created exclusively
    (two processes writing one path never rename each other's staging file, and a link
    planted at a predictable name is never followed)."""
    fd, staging_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    staging = Path(staging_name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        staging.replace(path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
