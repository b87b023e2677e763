"""The default number of torch threads: the cores nobody else is using, at least one."""

import pytest

from swarm_node import system


def _stat(ticks_per_cpu: list[tuple[int, int]]) -> str:
    """/proc/stat with (busy, idle) ticks per CPU (busy as user time, idle as idle)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 0 0 0 0 0 0" for n, (busy, idle) in enumerate(ticks_per_cpu)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    def make(busy_share: list[float], quota: str | None = None):
        """CPUs busy with other work for the given share of the sampling window."""
        monkeypatch.setattr(system.os, "sched_getaffinity", lambda pid: set(range(len(busy_share))))
        stat = tmp_path / "stat"
        stat.write_text(_stat([(1000, 1000)] * len(busy_share)))
        later = _stat([(1000 + int(100 * b), 1000 + 100 - int(100 * b)) for b in busy_share])
        monkeypatch.setattr(system, "PROC_STAT", stat)
        monkeypatch.setattr(system.time, "sleep", lambda s: stat.write_text(later))
        cpu_max = tmp_path / "cpu.max"
        cpu_max.unlink(missing_ok=True)
        if quota is not None:
            cpu_max.write_text(quota + "\n")
        monkeypatch.setattr(system, "CGROUP_CPU_MAX", cpu_max)

    return make


@pytest.mark.parametrize("busy_share, expected", [([0.05, 0.1], 2), ([1.0, 1.0], 1), ([1.0, 0.0], 1),
                                                  ([0.5, 0.5], 1), ([0.1] * 16, 14), ([0.0] * 8, 8),
                                                  ([1.0] * 4 + [0.0] * 4, 4)])
def test_busy_cores_are_left_alone(machine, busy_share, expected):
    machine(busy_share)
    assert system.default_threads() == expected


def test_only_the_cpus_this_process_may_use_count(machine, monkeypatch):
    machine([1.0, 1.0, 0.0, 0.0])
    monkeypatch.setattr(system.os, "sched_getaffinity", lambda pid: {2, 3})
    assert system.default_threads() == 2


def test_a_cgroup_quota_caps_the_cores(machine):
    machine([0.0] * 16, quota="150000 100000")
    assert system.free_cores() == 1.5
    assert system.default_threads() == 1  # half a core is not a thread's worth
    machine([0.0] * 16, quota="max 100000")
    assert system.default_threads() == 16


def test_without_proc_stat_the_load_average_stands_in(machine, monkeypatch, tmp_path):
    machine([0.0, 0.0])
    monkeypatch.setattr(system, "PROC_STAT", tmp_path / "missing")
    monkeypatch.setattr(system.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    assert system.default_threads() == 1
