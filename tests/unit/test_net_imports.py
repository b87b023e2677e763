"""Importing the network layer leaves scipy.optimize (hivemind's averager needs it; we do
not) to be imported on first use, and that first use still works."""

import subprocess
import sys

PROBE = """
import sys
import swarm_node.net.dht, swarm_node.node  # torch's imports probe every module's __file__
print(type(sys.modules["scipy.optimize"]).__name__, len([m for m in sys.modules if m.startswith("scipy.")]))
import hivemind.averaging.load_balancing as balancing
print(balancing.load_balance_peers(100, [1.0, 3.0]))  # solves a linear program with scipy
print(type(sys.modules["scipy.optimize"]).__name__)
"""


def test_scipy_optimize_waits_for_its_first_use():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    deferred, balance, after = out.stdout.split("\n")[:3]
    assert deferred.split()[0] == "_ImportedOnFirstUse" and int(deferred.split()[1]) < 20
    assert sum(int(share) for share in balance.strip("()").split(",")) == 100
    assert after == "module"
