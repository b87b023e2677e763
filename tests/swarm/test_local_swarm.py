"""`swarm-node local`: real node processes on loopback."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from bootstrap_harness import stop, wait_for
from shared_machine import COMPUTE_SHARE
from tagged_runs import TaggedRun


def run_local(tmp_path, method: str, steps: int = 90, dashboard: bool = False,
              extra: tuple[str, ...] = ()) -> tuple[dict, dict | None]:
    """Run ``swarm-node local``; with ``dashboard``, also return what its bootstrap's
    /api/status showed once all four nodes were training and had answered it (verified).
    Its output is in METHOD.log."""
    out, log = tmp_path / f"{method}.json", tmp_path / f"{method}.log"
    cmd = [sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--model",
           "debug",
           "--data", "synthetic:order=1", "--steps", str(steps), "--inner-steps", "30", "--method", method,
           "--json-out", str(out), "--no-progress", *(["--dashboard-port", "0"] if dashboard else []), *extra]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_tagged_env())
    status = None
    try:
        if dashboard:
            url = wait_for(lambda: re.search(r"dashboard: (http://\S+)", log.read_text()), 60,
                           "the dashboard", log)
            seen: set[str] = set()
            status = wait_for(lambda: _all_training(url.group(1).rstrip("/") + "/api/status", 4, seen, proc),
                              90,
                              "all four nodes in /api/status", log)
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    return json.loads(out.read_text()), status


# Every process a test here starts, and all they start, inherit this variable: other
# checkouts and other test workers on the same machine run swarms of their own.
TAGGED = TaggedRun("SWARM_TEST_RUN")
_tagged_env = TAGGED.env


def _ours_running(pattern: str) -> str:
    """Pids of live processes started by this module whose command line matches ``pattern``."""
    return " ".join(TAGGED.pids(pattern))


def _all_training(status_url: str, count: int, seen: set[str], proc: subprocess.Popen) -> dict | None:
    """The status once it lists ``count`` peers and each has been seen training and
    verified, in this poll or an earlier one: on a loaded machine the bootstrap's status
    requests time out now and then, and a peer it has to ask again is shown unverified
    for a while, so all four at once can take longer than the run lasts."""
    finished = "the swarm finished before its dashboard showed every peer training"
    assert proc.poll() is None, finished
    try:
        with urllib.request.urlopen(status_url, timeout=10) as response:
            status = json.loads(response.read())
    except urllib.error.URLError:  # the run (and its dashboard) ended since the check above
        assert proc.poll() is None, finished
        raise
    peers = [p for s in status["stages"] for p in s["peers"]]
    seen.update(p["peer_id"] for p in peers if p["state"] == "training" and p["verified"])
    return status if len(peers) == count and seen >= {p["peer_id"] for p in peers} else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    checkpoints = tmp / "checkpoints"
    (noloco, status) = run_local(tmp, "noloco", dashboard=True, extra=("--checkpoint-dir", str(checkpoints)))
    return {"noloco": noloco, "noloco_status": status, "checkpoints": checkpoints,
            "noloco_log": (tmp / "noloco.log").read_text(), "out": tmp}


def test_the_dashboard_of_a_local_swarm_lists_every_peer(runs):
    status = runs["noloco_status"]
    assert [s["num_peers"] for s in status["stages"]] == [2, 2]
    listed = {p["peer_id"] for s in status["stages"] for p in s["peers"]}
    assert listed == {p["peer_id"] for p in runs["noloco"]["peers"]}


def test_two_by_two_swarm_trains_and_every_peer_pairs(runs):
    summary = runs["noloco"]
    assert summary["final_val_loss"] < summary["val_loss_curve"][0][1] - 0.2  # the loss fell
    assert len(summary["peers"]) == 4
    for peer in summary["peers"]:
        assert peer["status"] == "finished"
        assert peer["rounds_with_partner"] >= 2, peer
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
    stage0 = [p for p in summary["peers"] if p["stage"] == 0]
    assert all(p["inner_steps"] == 90 for p in stage0)
    for key in ("peer_id", "stage", "pid", "inner_steps", "outer_rounds", "rounds_with_partner",
                "local_only_rounds", "bytes_sent", "bytes_received", "microbatches_done", "microbatches_lost",
                "retries"):
        assert all(key in p for p in summary["peers"]), key
    for key in ("tokens", "tokens_per_s", "final_val_loss", "val_loss_curve", "replica_weight_std", "wall_s"):
        assert key in summary, key


@pytest.mark.slow  # a second swarm; the simulator's test of the same claim runs in the default tier
def test_weight_exchange_keeps_replicas_closer_than_local_training(runs, tmp_path):
    local, _ = run_local(tmp_path, "local")
    for stage in range(2):
        assert runs["noloco"]["replica_weight_std"][stage] < local["replica_weight_std"][stage]
    assert all(p["outer_rounds"] == 0 for p in local["peers"])


def test_checkpoint_dir_keeps_every_node_and_the_export_command_printed_works(runs):
    from swarm_node.cli.main import main
    from swarm_node.export.assemble import assemble, load_model, read_stage_checkpoint

    expected = {str(runs["checkpoints"] / f"stage{s}-r{r}") for s in range(2) for r in range(2)}
    assert {p["checkpoint_dir"] for p in runs["noloco"]["peers"]} == expected
    for peer in runs["noloco"]["peers"]:
        _, meta = read_stage_checkpoint(Path(peer["checkpoint_dir"]))
        assert meta["stage"] == peer["stage"] and meta["peer_id"] == peer["peer_id"]
    assert load_model(assemble([Path(d) for d in sorted(expected)])).training is False
    command = re.search(r"swarm-node (export --checkpoint .*) --out MODEL_DIR", runs["noloco_log"])
    assert command, runs["noloco_log"][-2000:]
    args = command.group(1).split()
    assert set(args[2:]) == expected
    model_dir = runs["out"] / "model"
    assert main([*args, "--out", str(model_dir)]) == 0
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def test_nothing_is_left_behind(runs):
    assert _ours_running(".* -m swarm_node join") == ""
    assert _ours_running(".*/p2pd ") == ""
    # the dashboard's bootstrap (identity in a swarm-local-bootstrap-* temp dir) is gone too
    assert _ours_running(".* -m swarm_bootstrap .*swarm-local-bootstrap-") == ""


def test_a_node_killed_hard_is_reported_dead_and_named_and_the_rest_finish(tmp_path):
    run_dir = tmp_path / "run"
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "2", "--model",
           "debug",
           "--data", "synthetic:order=1", "--steps", "60", "--inner-steps", "30", "--run-dir", str(run_dir),
           "--round-timeout", "5", "--json-out", str(out), "--no-progress",
           *COMPUTE_SHARE]  # not to save time (the run is 60 steps either way): to see `local` pass it on
    swarm = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=_tagged_env())
    victim_log = run_dir / "node-s1-r1.log"
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and swarm.poll() is None:
        if victim_log.exists() and "round 0" in victim_log.read_text(errors="replace"):
            # the node itself, not its forked DHT child (same command line): a direct child of `local`
            found = subprocess.run(["pgrep", "-P", str(swarm.pid), "-f",
                                    f"{run_dir}/run-spec.json --stage 1"],
                                   capture_output=True, text=True).stdout.split()
            victim = int(found[-1]) if found else None
        time.sleep(0.2)  # polling a log file for a condition
    assert victim is not None, "the stage-1 nodes never got to their first round"
    assert "computing at most 25% of the time" in victim_log.read_text()  # `local` passed --compute-share on
    sockets = _hivemind_sockets_of(_ours_running(".").split())
    assert sockets, "found no socket of the swarm's processes to check afterwards"
    os.kill(victim, signal.SIGKILL)
    _, stderr = swarm.communicate(timeout=240)
    assert swarm.returncode == 1, stderr[-3000:]  # a node died: the run failed, whatever the others did
    assert f"dead: node stage 1 replica 1 (pid {victim}) died with exit code -9" in stderr
    summary = json.loads(out.read_text())
    by_pid = {p["pid"]: p for p in summary["peers"]}
    assert by_pid[victim]["status"] == "dead" and summary["dead_nodes"][0].startswith("stage 1 replica 1")
    others = [p for p in summary["peers"] if p["pid"] != victim]
    assert all(p["status"] == "finished" for p in others)
    # a round after the kill, alone in stage 1
    assert all(p["inner_steps"] == 60 for p in others if p["stage"] == 0)
    # replica 0's path is evaluated; replica 1's and the consensus need the dead node's weights
    assert summary["final_val_loss"] is not None and summary["final_consensus_val_loss"] is None
    assert [reason.split(":")[0] for reason in summary["evaluation_skipped"]] == ["replica 1",
                                                                                  "the consensus model"]
    assert _ours_running(".*/p2pd ") == ""
    # The victim's sockets are gone too: the daemons' and clients' files our processes had
    # open before the kill (other swarms on the machine have sockets of their own there).
    assert sorted(p for p in sockets if p.exists()) == []


def _hivemind_sockets_of(pids: list[str]) -> set[Path]:
    """The hivemind socket files (/tmp/hivemind-*.sock) these processes have open."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # gone meanwhile
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]
        if len(fields) == 8 and fields[6] in inodes and Path(fields[7]).name.startswith("hivemind-"):
            found.add(Path(fields[7]))
    return found

