"""`swarm-node local` when something goes wrong (slow tier: each runs real node processes).

A node that runs out of memory is reported dead, never done: named with its one-line
message, the run's exit status non-zero, nothing of the model it could not hold
evaluated. Ctrl-C or SIGTERM in any phase (start-up, training, a final evaluation whose
batch never ends) stops every process within 10 s and leaves nothing running. Faults
come in through tests/swarm/local_faults.py (the node program seam of swarm_node/local/swarm.py,
and an evaluation that blocks)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tagged_runs import TaggedRun

FAULTS = Path(__file__).with_name("local_faults.py")
TAGGED = TaggedRun("SWARM_FAULT_TEST_RUN")
LOCAL = ("--model", "debug", "--data", "synthetic:order=1", "--no-progress")

pytestmark = pytest.mark.slow


_env, _ours_running = TAGGED.env, TAGGED.running  # the processes this module started, and theirs


def _nothing_left(timeout_s: float = 3.0) -> list[str]:
    """What this module started and is still running once the killed have had time to go."""
    deadline = time.monotonic() + timeout_s
    while (left := _ours_running()) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for processes to end
    return left


def _start(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as sink:
        return subprocess.Popen([sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT, env=_env())


def _wait_for(condition, timeout_s: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"ended before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)  # polling a log for a condition


def _sigterm_and_time(proc: subprocess.Popen) -> float:
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return time.monotonic() - began


def test_a_node_out_of_memory_is_dead_named_and_its_model_not_evaluated(tmp_path):
    out, log = tmp_path / "out.json", tmp_path / "local.log"
    proc = _start(log, str(FAULTS), "oom", "0", "--", "--stages", "1", "--replicas", "1", "--steps", "20",
                  "--json-out", str(out), *LOCAL)
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    text = log.read_text()
    assert re.search(
        r"dead: node stage 0 replica 0 \(pid \d+\) died with exit code 2: swarm-node join: error: "
        r"out of memory on cpu",
        text,
    ), text[-3000:]
    assert "evaluating" not in text and "has done its" not in text
    summary = json.loads(out.read_text())
    assert summary["peers"][0]["status"] == "dead" and summary["peers"][0]["exit_code"] == 2
    assert summary["final_val_loss"] is None and summary["initial_val_loss"] is None
    assert summary["evaluation_skipped"][0].startswith("stage 0: no node of it finished (stage 0 replica 0")
    assert _nothing_left() == []


def test_a_dead_stage_stops_the_run_and_the_other_stage_is_not_evaluated_either(tmp_path):
    out, log = tmp_path / "out.json", tmp_path / "local.log"
    proc = _start(log, str(FAULTS), "oom", "1", "--", "--stages", "2", "--replicas", "2", "--steps", "400",
                  "--json-out", str(out), *LOCAL)
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    summary = json.loads(out.read_text())
    assert sorted(p["status"] for p in summary["peers"] if p["stage"] == 1) == ["dead", "dead"]
    assert len(summary["dead_nodes"]) == 2 and summary["final_val_loss"] is None
    assert "every node of stage 1 has died; stopping" in log.read_text()
    assert all(p["inner_steps"] < 400 for p in summary["peers"] if p["stage"] == 0)  # stopped, not run out
    assert _nothing_left() == []


def test_sigterm_during_a_final_evaluation_that_never_ends_stops_everything_within_10_s(tmp_path):
    log = tmp_path / "local.log"
    proc = _start(log, str(FAULTS), "stuck-eval", "--", "--stages", "1", "--replicas", "1", "--steps", "10",
                  *LOCAL)
    _wait_for(lambda: "evaluation stuck" in log.read_text(), 240, "evaluation", proc, log)
    assert _sigterm_and_time(proc) <= 10
    assert proc.returncode == 130 and "interrupted" in log.read_text()
    assert _nothing_left() == []


def test_sigterm_during_training_stops_every_node_within_10_s(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "local.log"
    proc = _start(log, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--steps", "100000",
                  "--inner-steps", "10", "--run-dir", str(run_dir), *LOCAL)
    node_log = run_dir / "node-s1-r0.log"
    _wait_for(lambda: node_log.exists() and "round 0" in node_log.read_text(errors="replace"), 240,
              "a stage-1 round", proc, log)
    assert _sigterm_and_time(proc) <= 10
    assert proc.returncode == 130
    assert _nothing_left() == []


def test_sigterm_while_the_nodes_start_stops_them_within_10_s(tmp_path):
    log = tmp_path / "local.log"
    proc = _start(log, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--steps", "100000",
                  *LOCAL)
    _wait_for(lambda: "bootstrap DHT at" in log.read_text(), 120, "the bootstrap", proc, log)
    assert _sigterm_and_time(proc) <= 10
    assert proc.returncode == 130
    assert _nothing_left() == []
