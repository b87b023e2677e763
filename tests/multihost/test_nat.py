"""A volunteer behind a home router (NAT) types the same line as everyone else. Peers
dial it back and fail, so it says so in one line with what to open, runs as a DHT client,
takes stage 0 (which only calls out), pairs by proposing to reachable peers itself, and
nobody ever opens a stream to it."""

from __future__ import annotations

import pytest
from swarm_hosts import BootstrapOnHost, Volunteer, run_spec_file, wait_for

pytestmark = pytest.mark.usefixtures("iptables")


def test_a_volunteer_behind_nat_trains_stage_0_and_pairs_by_calling_out(bed, tmp_path):
    spec = run_spec_file(tmp_path, run_id="nat")
    boot = BootstrapOnHost(bed, bed.add_host("boot"), tmp_path, "--run-spec", str(spec))
    line = boot.join_line()
    # a home connection: 20 Mbit/s each way, 40 ms added to every round trip
    home = Volunteer(bed, bed.add_host("home", behind_nat=True, rate_mbit=20, rtt_ms=40), tmp_path, line)
    public = [Volunteer(bed, bed.add_host(f"pub{i}"), tmp_path, line) for i in range(2)]

    def home_paired_twice():
        for v in (home, *public):
            assert v.process.poll() is None, f"{v.host.name} exited:\n{v.text()[-3000:]}"
        peers = {p["short_id"]: p for p in boot.peers()}
        mine = peers.get(home.peer_id() or "?")
        return peers if len(peers) == 3 and mine and mine["partner_rounds"] >= 2 else None

    peers = wait_for(home_paired_twice, 300, "the volunteer behind NAT to average with a partner twice",
                     tmp_path)
    mine = peers[home.peer_id()]
    assert mine["stage"] == 0 and not mine["reachable"] and mine["state"] == "training", mine
    others = [p for sid, p in peers.items() if sid != home.peer_id()]
    assert all(p["reachable"] for p in others) and sorted(p["stage"] for p in others) == [0, 1]
    warnings = [ln for ln in home.text().splitlines() if "cannot be reached by other peers" in ln]
    assert len(warnings) == 1 and "TCP port 31338" in warnings[0] and "--public-ip" in warnings[0], warnings
    assert f"/ip4/{home.host.public_address}" in warnings[0]  # where the peers saw it, and dialled in vain
    bed.stop_processes(home.host)  # first: with the others gone its last micro-batches would be lost
    bed.stop_processes(*(v.host for v in public))
    final = home.metrics()[-1]
    assert final["rounds_with_partner"] >= 2 and final["microbatches_lost"] == 0, final
    # Nobody routed to it, proposed to it or asked it for state. The one stream it may
    # answer is the bootstrap's status request (over the connection the volunteer opened),
    # which is how the dashboard learns that a peer exists.
    assert final["streams_served"] == (1 if mine["verified"] else 0), (final, mine)
    for v in public:
        assert home.peer_id() not in "".join(ln for ln in v.text().splitlines() if "failed" in ln)
