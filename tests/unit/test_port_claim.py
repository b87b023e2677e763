"""One peer per port (swarm_node/net/ports.py). libp2p's daemon binds with SO_REUSEPORT,
so two nodes started at the same moment on one port both passed the bind probe and
then shared the port. Now each claims its ports first: of two processes claiming one
port at the same moment exactly one gets it, every time; the kernel frees the claim
when its holder dies, however it dies; a port some other program listens on is still
refused by the probe; port 0 is never claimed."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from swarm_node.errors import ConfigError
from swarm_node.net import dht as dht_module
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.ports import claim_ports, listen_ports

BACKENDS = [pytest.param(True, id="abstract-socket"), pytest.param(False, id="lock-file")]
CLAIMED = "is in use (another swarm-node on this machine is starting or running there): pass --port"

# A process that claims a port whenever told to ("claim PORT"), says whether it won, and
# holds its claim until told to let go ("release"): both racers are told at once.
CLAIMER = """
import sys
from swarm_node.errors import ConfigError
from swarm_node.net.ports import claim_ports

abstract = sys.argv[1] == "1"
claim = None
print("ready", flush=True)
for line in sys.stdin:
    command, *argument = line.split()
    if command == "claim":
        try:
            claim = claim_ports([f"/ip4/127.0.0.1/tcp/{argument[0]}"], abstract=abstract)
            print("won", flush=True)
        except ConfigError as exc:
            print("lost", exc, flush=True)
    elif command == "release":
        if claim is not None:
            claim.release()
            claim = None
        print("released", flush=True)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def claimer(abstract: bool, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the lock files of this test only
    process = subprocess.Popen([sys.executable, "-c", CLAIMER, "1" if abstract else "0"],
                               stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline() == "ready\n"
    return process


def tell(process: subprocess.Popen, line: str) -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # lock files of this process: the test's own
    return tmp_path


@pytest.mark.parametrize("abstract", BACKENDS)
def test_of_two_processes_claiming_a_port_at_once_exactly_one_gets_it_ten_times_out_of_ten(abstract, own_tmp):
    racers = [claimer(abstract, own_tmp) for _ in range(2)]
    try:
        for _ in range(10):
            port = free_port()
            for racer in racers:
                tell(racer, f"claim {port}")  # both are waiting on their stdin: they claim at the same moment
            answers = [racer.stdout.readline().strip() for racer in racers]
            assert sorted(a.split()[0] for a in answers) == ["lost", "won"], answers
            lost = next(a for a in answers if a.startswith("lost"))
            assert lost == (f"lost TCP port {port} {CLAIMED} with a free port (and forward that one if this "
                            "machine is behind a router)")
            for racer in racers:
                tell(racer, "release")
                assert racer.stdout.readline() == "released\n"
    finally:
        for racer in racers:
            racer.stdin.close()
            racer.wait(timeout=30)


@pytest.mark.parametrize("abstract", BACKENDS)
@pytest.mark.parametrize("death", ["SIGKILL", "SIGTERM", "exit"])
def test_the_claim_ends_with_its_holder_however_it_dies(abstract, death, own_tmp):
    port = free_port()
    holder = claimer(abstract, own_tmp)
    try:
        tell(holder, f"claim {port}")
        assert holder.stdout.readline() == "won\n"
        with pytest.raises(ConfigError, match=re.escape(CLAIMED)):
            claim_ports([f"/ip4/0.0.0.0/tcp/{port}"], abstract=abstract)  # any address: the port is claimed
        if death == "exit":
            holder.stdin.close()
        else:
            holder.send_signal(getattr(signal, death))
        holder.wait(timeout=30)
    finally:
        holder.kill()
    claim_ports([f"/ip4/127.0.0.1/tcp/{port}"], abstract=abstract).release()


@pytest.mark.parametrize("abstract", BACKENDS)
def test_a_claim_in_this_process_holds_until_released(abstract, own_tmp):
    port = free_port()
    maddrs = [f"/ip4/127.0.0.1/tcp/{port}", f"/ip6/::1/tcp/{port}/p2p/QmSelf"]
    assert listen_ports(maddrs) == [port]  # one claim for the port, whatever the addresses
    first = claim_ports(maddrs[:1], abstract=abstract)
    with pytest.raises(ConfigError, match=re.escape(CLAIMED)):
        claim_ports(maddrs[:1], abstract=abstract)  # a second peer of this process, too
    first.release()
    first.release()  # idempotent
    claim_ports(maddrs[:1], abstract=abstract).release()


# Python 3.12+ warns of any fork in a process with threads (the test runner's); this
# child only writes, reads and exits, as hivemind's forks are what the test is about.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("abstract", BACKENDS)
def test_a_forked_child_does_not_keep_the_claim(abstract, own_tmp):
    """hivemind forks a DHT process for each peer: the one of a second peer of this
    process must not hold the first peer's port once that one has shut down."""
    maddrs = [f"/ip4/127.0.0.1/tcp/{free_port()}"]
    claim = claim_ports(maddrs, abstract=abstract)
    (hold, done), (started, ready) = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # the child of a fork starts with copies of every open descriptor
        os.write(ready, b"x")  # past the fork's handlers
        os.read(hold, 1)
        os._exit(0)
    try:
        assert os.read(started, 1) == b"x"
        claim.release()
        claim_ports(maddrs, abstract=abstract).release()  # while the child lives
    finally:
        os.write(done, b"x")
        os.waitpid(child, 0)
        for end in (hold, done, started, ready):
            os.close(end)


def test_a_port_another_program_listens_on_is_refused_without_any_claim():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ConfigError, match=f"TCP port {port} is in use \\(another node or program"):
            claim_ports([f"/ip4/127.0.0.1/tcp/{port}"])
    claim_ports([f"/ip4/127.0.0.1/tcp/{port}"]).release()  # the refused claim was given back


def test_port_zero_and_other_transports_are_never_claimed():
    maddrs = ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0", "/ip4/0.0.0.0/udp/31338/quic",
              "/dns4/example.org/tcp/31338"]
    assert listen_ports(maddrs) == []
    claims = [claim_ports(maddrs) for _ in range(2)]  # any free port: every daemon gets its own
    assert all(claim.ports == () for claim in claims)


def test_a_peer_claims_its_port_before_its_daemon_starts_and_gives_it_back_at_shutdown(monkeypatch):
    """Nodes and bootstraps start their DHT through SwarmDHT.start: a second peer of this
    machine on the port stops there, before any daemon; the claim outlives the start and
    ends with the peer. (tests/swarm/test_port_race_slow.py races two real `join` processes.)"""
    host = [f"/ip4/127.0.0.1/tcp/{free_port()}"]
    daemons = []

    class FakeDHT:  # hivemind's DHT process and its daemon
        peer_id = "QmSelf"

        def __init__(self, **kwargs):
            with pytest.raises(ConfigError, match=re.escape(CLAIMED)):
                claim_ports(kwargs["host_maddrs"])  # claimed while the daemon starts
            daemons.append(kwargs["host_maddrs"])

        def shutdown(self):
            pass

    monkeypatch.setattr(dht_module, "DHT", FakeDHT)

    async def scenario():
        first = await SwarmDHT.start(host_maddrs=host)
        with pytest.raises(ConfigError, match=re.escape(CLAIMED)):
            await SwarmDHT.start(host_maddrs=host)
        assert len(daemons) == 1  # the second peer started none
        await first.shutdown()
        again = await SwarmDHT.start(host_maddrs=host)
        await again.shutdown()

    asyncio.run(scenario())
    assert daemons == [host, host]
    claim_ports(host).release()
