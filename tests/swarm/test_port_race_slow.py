"""Two `swarm-node join` started at the same moment on one port (a machine with two
GPUs, one node per card, started by one script without --port). libp2p's daemon binds
with SO_REUSEPORT: both passed the bind probe before either daemon listened, then
shared 31338, and neither ever trained. Now one goes on and the other stops at once
with the one-line error the README promises (exit status 2).

Each racer is the real CLI with every import done before the start line, so both reach
the port at the same moment; the one that gets past the claim stops where its daemon
would start (nothing binds the port, so only the claim can tell the racers apart).
Slow tier: the two racers import the whole node (torch, hivemind), 14 s on a loaded
2-core machine; the default tier's tests/unit/test_port_claim.py covers the claim and
SwarmDHT.start's use of it."""

import socket
import subprocess
import sys

import pytest

from swarm_node.data.spec import DataSpec
from swarm_node.optim import default_method
from swarm_node.spec import RunSpec

SPEC = RunSpec(run_id="port-race", model_size="debug", num_stages=2, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=2))
pytestmark = pytest.mark.slow

RACER = """
import asyncio
import sys

import swarm_node.node.conductor  # every import first: both racers reach the port at the same moment
from swarm_node.cli import main as cli
from swarm_node.errors import SwarmError
from swarm_node.net import dht


async def past_the_claim(*args, **kwargs):
    print("past the claim", flush=True)  # where the daemon would start: we hold the port
    await asyncio.to_thread(sys.stdin.readline)  # until the test has seen the other racer end
    raise SwarmError("stopped by the test")


dht._start_dht_patiently = past_the_claim
print("ready", flush=True)
sys.stdin.readline()  # the start line: both racers are told at once
sys.exit(cli.main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_of_two_joins_started_together_on_one_port_one_goes_on_and_the_other_says_the_port_is_in_use(
    tmp_path,
):
    spec_path = tmp_path / "run-spec.json"
    SPEC.write_json(spec_path)
    port = free_port()
    argv = ["join", "--config", str(spec_path), "--port", str(port), "--device", "cpu", "--threads", "1",
            "--no-progress", "--metrics", "none", "--run-dir", str(tmp_path)]
    racers = []
    for name in ("a", "b"):
        with open(tmp_path / f"{name}.err", "wb") as err:
            racers.append(subprocess.Popen([sys.executable, "-c", RACER, *argv], cwd=tmp_path, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err))
    try:
        assert [racer.stdout.readline() for racer in racers] == ["ready\n", "ready\n"]
        for racer in racers:
            racer.stdin.write("go\n")
            racer.stdin.flush()
        # the winner says so; the loser's output ends when it exits
        said = [racer.stdout.readline() for racer in racers]
        assert sorted(said) == ["", "past the claim\n"], said
        loser, winner = (racers[0], racers[1]) if said[0] == "" else (racers[1], racers[0])
        assert loser.wait(timeout=60) == 2
        errors = (tmp_path / ("a.err" if loser is racers[0] else "b.err")).read_text()
        assert errors.splitlines()[-1] == (
            f"swarm-node join: error: TCP port {port} is in use (another swarm-node on this machine is "
            f"starting or running there): pass --port with a free port (and forward that one if this machine "
            f"is behind a router)"
        ), errors
        assert "Traceback" not in errors
        assert winner.poll() is None  # still holding the port
        winner.stdin.write("stop\n")
        winner.stdin.flush()
        assert winner.wait(timeout=60) == 2  # "stopped by the test", where its daemon would have started
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
