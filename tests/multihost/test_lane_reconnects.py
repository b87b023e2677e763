"""Direct lanes between two hosts of their own (TLS, per-address caps in force): a
caller that opens a lane, uses it once and lets it go, a hundred times over, is served
on a lane every time, and the server counts each lane against the caller's address only
while it is open (a lane that was not let go of stayed counted for good, and past 16 of
them every later lane from that address was refused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from swarm_hosts import volunteer_env, wait_for

PEER = Path(__file__).with_name("lane_peer.py")
RECONNECTS = 100


def test_lanes_between_two_hosts_survive_a_hundred_reconnects_from_one_address(bed, tmp_path):
    server_host, caller_host = bed.add_host("lanesrv"), bed.add_host("lanecall")
    server_log, caller_log, maddr = tmp_path / "serve.log", tmp_path / "call.log", tmp_path / "server.maddr"
    bed.popen(server_host, [sys.executable, str(PEER), "serve", "--host", server_host.address, "--maddr-file",
                            str(maddr)], env=volunteer_env(), log=server_log)
    caller = bed.popen(caller_host, [sys.executable, str(PEER), "call", "--host", caller_host.address,
                                     "--maddr-file", str(maddr), "--lanes", str(RECONNECTS)],
                       env=volunteer_env(), log=caller_log)
    wait_for(lambda: caller.poll() is not None, 120, "the caller's lanes", tmp_path)
    lines = [json.loads(ln) for ln in caller_log.read_text().splitlines() if ln.startswith("{")]
    report = next((line for line in lines if "during" in line), None)
    assert report is not None, (caller_log.read_text()[-3000:], server_log.read_text()[-3000:])
    print(f"{RECONNECTS} lanes, one after the other, in {report['seconds']} s")
    assert report["lanes_opened"] == RECONNECTS and report["direct"], report
    assert report["during"] == [{caller_host.address: 1}] * RECONNECTS, report["during"][:20]
    assert report["after"] == [{}] * RECONNECTS, report["after"][:20]
