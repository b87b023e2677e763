"""A one-stage run on prepared data, two volunteers on hosts of their own, while a
stranger claims one volunteer's data slot (slot_forger.py: a signed stage-0 record
for a peer id that sorts before the victim's, stored again every 3 s with the victim's
slot of the moment, nobody behind it). The claim moves nothing: the victim never
leaves its slot, trains no shard twice in a pass, and the two volunteers' shards stay
disjoint. (Believed, the same claims flipped the victim between two slots every 5 s,
training the first shard of each again each time.) Slow: about 3 minutes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from netbed import stop
from swarm_hosts import BootstrapOnHost, Volunteer, volunteer_env, wait_for
from test_prepared_run import _prepare_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FORGER = Path(__file__).with_name("slot_forger.py")
FORGING_S = 90


def _trained(volunteer: Volunteer) -> list[tuple[str, int, int]]:
    """(shard, pass, slot) of each shard the volunteer began, in order."""
    return [(name, int(p), int(slot)) for name, p, slot in
            re.findall(r"data: training (\S+) \(pass (\d+), slot (\d+)", volunteer.text())]


def test_a_forged_claim_on_a_volunteers_slot_moves_nothing(bed, tmp_path):
    host = bed.add_host("boot")
    _, spec = _prepare_on(bed, host, tmp_path, shard_tokens=4096, chunk_kb=4, slots=4, num_stages=1)
    boot = BootstrapOnHost(bed, host, tmp_path, "--run-spec", str(spec), "--data", str(tmp_path / "data"))
    line = boot.join_line()
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}"), tmp_path, line) for i in range(2)]
    wait_for(lambda: all(_trained(v) for v in volunteers), 600, "both volunteers to train", tmp_path)
    victim, other = sorted(volunteers, key=lambda v: v.peer_id(), reverse=True)
    log = tmp_path / "slot_forger.log"
    argv = [sys.executable, str(FORGER), "--initial-peers", boot.maddr, "--run-id", "real-text",
            "--spec-hash", boot.status()["spec_hash"], "--victim", victim.peer_id(),
            "--seconds", str(FORGING_S)]
    forger = bed.popen(bed.add_host("evil"), argv, env=volunteer_env(), log=log)
    try:
        wait_for(lambda: '"ready"' in log.read_text(), 300, "the forger's first claim", tmp_path)
        before = len(victim.text())
        wait_for(lambda: forger.poll() is not None, FORGING_S + 120, "the forger to finish", tmp_path)
    finally:
        stop(forger)
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    assert summary["victim"].endswith(victim.peer_id()) and summary["stores"] >= FORGING_S // 10, summary
    assert summary["forger"] < summary["victim"]
    assert "is another peer's; moving" not in victim.text()[before:]
    trained = _trained(victim)
    assert summary["claimed"] == [trained[-1][2]]  # the forger claimed the victim's slot all along
    assert len({(name, p) for name, p, _ in trained}) == len(trained), trained  # no shard twice in a pass
    theirs = _trained(other)
    for data_pass in range(min(trained[-1][1], theirs[-1][1])):  # passes both have finished
        mine = {name for name, p, _ in trained if p == data_pass}
        assert not mine & {name for name, p, _ in theirs if p == data_pass}, (data_pass, trained, theirs)
    print(f"forger {summary['forger'][-6:]} stored {summary['stores']} claims on slot {summary['claimed']}; "
          f"victim {victim.peer_id()} trained {len(trained)} shards, never moved")
