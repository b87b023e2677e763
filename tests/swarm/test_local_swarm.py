"""`swarm-node local`: real node processes on loopback."""

import json
import subprocess
import sys

import pytest


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
