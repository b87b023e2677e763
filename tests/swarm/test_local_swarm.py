"""`swarm-node local`: real node processes on loopback."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from bootstrap_harness import stop, wait_for


def run_local(tmp_path, method: str, steps: int = 150):
    out = tmp_path / f"{method}.json"
    cmd = [sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--model", "debug",
           "--data", "synthetic:order=1", "--steps", str(steps), "--inner-steps", "30", "--method", method, "--json-out", str(out),
           "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    return {m: run_local(tmp, m) for m in ("noloco", "local")}


def test_two_by_two_swarm_trains_and_every_peer_pairs(runs):
    summary = runs["noloco"]
    assert summary["final_val_loss"] < summary["val_loss_curve"][0][1] - 0.2  # the loss fell
    assert len(summary["peers"]) == 4
    for peer in summary["peers"]:
        assert peer["status"] == "finished"
        assert peer["rounds_with_partner"] >= 2, peer
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
    stage0 = [p for p in summary["peers"] if p["stage"] == 0]
    assert all(p["inner_steps"] == 150 for p in stage0)
    for key in ("peer_id", "stage", "pid", "inner_steps", "outer_rounds", "rounds_with_partner",
                "local_only_rounds", "bytes_sent", "bytes_received", "microbatches_done", "microbatches_lost",
                "retries"):
        assert all(key in p for p in summary["peers"]), key
    for key in ("tokens", "tokens_per_s", "final_val_loss", "val_loss_curve", "replica_weight_std", "wall_s"):
        assert key in summary, key


def test_weight_exchange_keeps_replicas_closer_than_local_training(runs):
    for stage in range(2):
        assert runs["noloco"]["replica_weight_std"][stage] < runs["local"]["replica_weight_std"][stage]
    assert all(p["outer_rounds"] == 0 for p in runs["local"]["peers"])


def test_nothing_is_left_behind(runs):
    leftovers = subprocess.run(["pgrep", "-f", "swarm_node join"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
    daemons = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout
    assert daemons.strip() == ""


def test_a_node_killed_hard_is_reported_lost_and_the_rest_finish(tmp_path):
    run_dir = tmp_path / "run"
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--model", "debug",
           "--data", "synthetic:order=1", "--steps", "200", "--inner-steps", "30", "--run-dir", str(run_dir),
           "--round-timeout", "5", "--json-out", str(out), "--no-progress"]
    sockets_before = set(Path("/tmp").glob("hivemind-*.sock"))
    swarm = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim_log = run_dir / "node-s1-r1.log"
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and swarm.poll() is None:
        if victim_log.exists() and "round 0" in victim_log.read_text(errors="replace"):
            # the node itself, not its forked DHT child (same command line): a direct child of `local`
            found = subprocess.run(["pgrep", "-P", str(swarm.pid), "-f", f"{run_dir}/run-spec.json --stage 1"],
                                   capture_output=True, text=True).stdout.split()
            victim = int(found[-1]) if found else None
        time.sleep(0.2)  # polling a log file for a condition
    assert victim is not None, "the stage-1 nodes never got to their first round"
    os.kill(victim, signal.SIGKILL)
    _, stderr = swarm.communicate(timeout=240)
    assert swarm.returncode == 0, stderr[-3000:]
    assert "died with exit code -9" in stderr
    summary = json.loads(out.read_text())
    by_pid = {p["pid"]: p for p in summary["peers"]}
    assert by_pid[victim]["status"] == "lost"
    others = [p for p in summary["peers"] if p["pid"] != victim]
    assert all(p["status"] == "finished" for p in others)
    assert all(p["inner_steps"] == 200 for p in others if p["stage"] == 0)
    assert summary["final_val_loss"] is not None
    assert subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True).stdout == b""
    assert set(Path("/tmp").glob("hivemind-*.sock")) <= sockets_before  # the victim's sockets are gone too


def test_local_swarm_with_a_dashboard_lists_every_peer_in_status(tmp_path):
    out = tmp_path / "local.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2",
                                 "--data", "synthetic", "--steps", "300", "--dashboard-port", "0", "--no-progress"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for(lambda: re.search(r"dashboard: (http://\S+)", out.read_text()), 60, "the dashboard URL", out)
        status_url = url.group(1).rstrip("/") + "/api/status"

        def four_training() -> dict | None:
            with urllib.request.urlopen(status_url, timeout=10) as response:
                status = json.loads(response.read())
            training = [p for s in status["stages"] for p in s["peers"] if p["state"] == "training"]
            return status if len(training) == 4 else None

        status = wait_for(four_training, 60, "all four nodes in /api/status", out)
        assert [s["num_peers"] for s in status["stages"]] == [2, 2]
        assert proc.wait(timeout=180) == 0
    finally:
        stop(proc)
    # its bootstrap (identity in a swarm-local-bootstrap-* temp dir) is gone with it
    assert not subprocess.run(["pgrep", "-f", "swarm-local-bootstrap-"], capture_output=True).stdout
