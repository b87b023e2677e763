"""A benchmark's volunteers compute as a volunteer's node would: the compute share the
multi-host tests give their nodes (tests/shared_machine.py) once reached the home-link
benchmark through the shared Volunteer helper, and its nodes rested 3/4 of the time."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "multihost")]
from swarm_hosts import Volunteer  # noqa: E402 (found through the sys.path line above)


class _Bed:
    def __init__(self):
        self.argv = None

    def popen(self, host, argv, **_):
        self.argv = argv


class _Host:
    name = "v0"


@pytest.mark.parametrize("full_speed", [False, True])
def test_a_volunteer_rests_only_where_a_test_asks(tmp_path, full_speed):
    bed = _Bed()
    Volunteer(bed, _Host(), tmp_path, "swarm-node join --initial-peers X", "--threads", "1",
              full_speed=full_speed)
    command = bed.argv[-1]
    assert ("--compute-share" in command) is not full_speed, command
    assert command.endswith("--threads 1")


def test_every_benchmark_volunteer_runs_at_full_speed():
    calls = []
    for path in (REPO / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Volunteer":
                full = any(k.arg == "full_speed" and getattr(k.value, "value",
                                                             None) is True for k in node.keywords)
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", full))
    assert calls, "no benchmark starts volunteers any more: drop this test"
    assert all(full for _, full in calls), [where for where, full in calls if not full]
