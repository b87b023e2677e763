"""`swarm-node local` with a coded stage boundary (docs/ALGORITHM.md section 9): two real
node processes on loopback send the code and the token ids between them, and the run
ends with a finite loss below the initial one and no micro-batch lost. Slow: about 40 s
on a loaded 2-core machine (tests/inproc/test_coded_boundary.py covers the data path in
the default tier)."""

import json
import math
import subprocess
import sys

import pytest
from bootstrap_harness import stop
from tagged_runs import TaggedRun

TAGGED = TaggedRun("SWARM_TEST_RUN")


@pytest.mark.slow
def test_a_local_swarm_with_a_bottleneck_boundary_trains(tmp_path):
    out, log = tmp_path / "coded.json", tmp_path / "coded.log"
    cmd = [sys.executable, "-m", "swarm_node", "local", "--stages", "2", "--replicas", "1",
           "--model", "debug", "--steps", "20", "--activation-codec", "bottleneck8", "--activation-ratio",
           "32",
           "--json-out", str(out), "--no-progress"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=TAGGED.env())
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads(out.read_text())
    final, initial = summary["final_val_loss"], summary["initial_val_loss"]
    assert math.isfinite(final) and final < initial
    assert all(peer["microbatches_lost"] == 0 for peer in summary["peers"]), summary["peers"]
    assert TAGGED.pids("-m swarm_node join|/p2pd ") == []  # every node and daemon stopped
