"""A 2 x 2 run while a stranger stores 60 forged stage-1 records, each signed with a
fresh key (peer ids nobody runs), claiming a throughput of 1e9, `seeking`, loss 0.001
and a billion steps: 30 claiming to live an hour, 30 renewed every 5 s with the usual
expiry. In a red-team run such records took most of the routing weight (32 micro-
batches lost in 90 s), filled partner search, and moved the dashboard's loss. Slow:
about 4 minutes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from swarm_hosts import measure_window, two_by_two, volunteer_env, wait_for

pytestmark = pytest.mark.slow

FORGER = Path(__file__).with_name("forger.py")
WINDOW_S = 60.0


def test_forged_records_cost_at_most_2_micro_batches_and_30_percent_of_tokens_per_s(bed, tmp_path):
    boot, volunteers = two_by_two(bed, tmp_path, "forged")
    undisturbed, lost_undisturbed = measure_window(boot, WINDOW_S)

    log = tmp_path / "forger.log"
    forger = bed.popen(bed.add_host("evil"),
                       [sys.executable, str(FORGER), "--initial-peers", boot.maddr, "--run-id", "forged",
                        "--spec-hash", boot.status()["spec_hash"], "--stage", "1", "--count", "30",
                        "--seconds", str(WINDOW_S + 30)], env=volunteer_env(), log=log)
    wait_for(lambda: '"ready"' in log.read_text(), 120, "the forger to store its first records", tmp_path)
    shown = wait_for(lambda: (s := boot.status()) and s["unverified_peers"] >= 20 and s, 60,
                     "the forged records to reach the bootstrap", tmp_path)
    forged, lost_forged = measure_window(boot, WINDOW_S)
    status = boot.status()
    print(
        f"tokens/s undisturbed {undisturbed:.0f}, with forged records {forged:.0f} "
        f"({forged / undisturbed:.0%}); "
        f"micro-batches lost {lost_undisturbed} then {lost_forged}; bootstrap: {status['num_peers']} peers, "
        f"{status['unverified_peers']} unverified records, {status['foreign_records']} refused, "
        f"loss {status['loss']}"
    )
    assert forged >= 0.7 * undisturbed and lost_forged <= lost_undisturbed + 2
    # the dashboard: forged records listed as unverified, counted nowhere; the hour-long ones refused
    assert shown["num_peers"] == status["num_peers"] == 4
    assert status["loss"] is not None and status["loss"] > 0.5  # the forged 0.001 moves nothing
    assert status["foreign_records"] >= 20
    wait_for(lambda: forger.poll() is not None, 120, "the forger to finish", tmp_path)
    assert json.loads(log.read_text().strip().splitlines()[-1])["short"] > 0
    for v in volunteers:
        assert v.process.poll() is None, v.text()[-2000:]
