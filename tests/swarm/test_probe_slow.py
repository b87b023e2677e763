"""`swarm-node probe` against real nodes: py-libp2p, in its own virtual environment and
process, connects with Noise or TLS and yamux, pings, identifies and reads
/swarm-node/status/1.0.0; every failure is one clear line.

The probe's environment is `swarm-node probe --setup`'s (reused when present; creating it
takes about a minute and needs PyPI)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm_node import __version__
from swarm_node.cli.probe import probe_venv, venv_python
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.identity import ensure_identity, peer_id_of_identity
from swarm_node.probe import SCRIPT
from swarm_node.spec import RunSpec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "examples" / "debug-synthetic.toml"  # two stages: a lone stage-0 node waits, nearly idle


@pytest.fixture(scope="module")
def probe_env() -> dict:
    venv = probe_venv()
    python = venv_python(venv)
    ready = python.exists() and subprocess.run([str(python), "-I", str(SCRIPT), "--check-install"],
                                               capture_output=True, timeout=120).returncode == 0
    if not ready:
        setup = subprocess.run([sys.executable, "-m", "swarm_node", "probe", "--setup"], capture_output=True,
                               text=True, timeout=900)
        if setup.returncode != 0:
            message = f"`swarm-node probe --setup` failed (needs PyPI): {setup.stderr[-1500:]}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
    return dict(os.environ, SWARM_PROBE_VENV=str(venv))


def start_node(tmp_path: Path, name: str, spec_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A `swarm-node join` process of stage 0 and the multiaddr it prints."""
    log_path = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "swarm_node", "join", "--config", str(spec_path), "--stage", "0", "--device",
           "cpu",
           "--threads", "1", "--run-dir", str(tmp_path / name), "--metrics", "none", "--no-progress",
           "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = re.search(r"--initial-peers (/\S+/p2p/\S+)", log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)  # polling the log, not synchronisation
    stop(proc)
    raise AssertionError(f"node {name} did not start: {log_path.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_probe(env: dict, maddr: str, *extra: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "swarm_node", "probe", maddr, "--timeout", "30", *extra],
                          capture_output=True, text=True, env=env, timeout=120)
    print(
        f"probe {' '.join(extra)}: {time.monotonic() - started:.1f} s, exit {done.returncode}\n{done.stdout}"
    )
    return done


def verdict(done: subprocess.CompletedProcess) -> str:
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc, maddr = start_node(tmp_path_factory.mktemp("probe"), "open", SPEC)
    yield maddr
    stop(proc)


def test_probe_reads_a_nodes_status_over_noise(probe_env, node):
    done = run_probe(probe_env, node, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    spec = RunSpec.from_file(SPEC)
    status = report["status"]
    assert report["ok"] and report["verdict"].startswith(
        f"OK: node {status['peer_id']} of run 'debug-synthetic'"
    )
    assert status["run_id"] == spec.run_id and status["spec_hash"] == spec.spec_hash()
    assert status["stage"] == 0 and status["num_stages"] == 2 and status["version"] == __version__
    assert status["peer_id"] == node.rsplit("/p2p/", 1)[1] == report["peer_id"]
    assert report["identify"]["speaks_status"] and report["ping_ms"] >= 0
    served = set(report["identify"]["protocols"])
    assert {"/ipfs/ping/1.0.0", "/swarm-node/pair/1.0.0", "/swarm-node/outer/4.0.0",
            "/swarm-node/outer-fetch/2.0.0", "/swarm-node/state/3.0.0"} <= served


def test_probe_over_tls_prints_a_one_line_verdict(probe_env, node):
    done = run_probe(probe_env, node, "--security", "tls")
    assert done.returncode == 0, done.stdout + done.stderr
    line = verdict(done)
    assert line.startswith(f"OK: node {node.rsplit('/p2p/', 1)[1]} of run 'debug-synthetic'")
    assert "stage 0 of 2" in line and f"swarm-node {__version__}" in line and "TLS 1.3 + yamux" in line


def test_probing_a_closed_port_fails_with_a_clear_line(probe_env, node):
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_probe(probe_env, f"/ip4/127.0.0.1/tcp/{port}/p2p/{node.rsplit('/p2p/', 1)[1]}")
    assert done.returncode == 1
    assert re.match(r"cannot connect to /ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+: .*Connection refused",
                    verdict(done))


def test_probing_a_peer_without_the_status_protocol_says_so(probe_env):
    loop = asyncio.new_event_loop()
    # a hivemind peer, like a bootstrap: no swarm-node protocols
    dht = loop.run_until_complete(SwarmDHT.start())
    try:
        done = run_probe(probe_env, dht.visible_maddrs()[0])
    finally:
        loop.run_until_complete(dht.shutdown())
        loop.close()
    assert done.returncode == 1
    assert verdict(done).startswith("connected, but the node does not speak /swarm-node/status/1.0.0")


def test_a_closed_run_refuses_the_probe(probe_env, tmp_path):
    identity = tmp_path / "member.key"
    ensure_identity(identity)
    closed = dataclasses.replace(RunSpec.from_file(SPEC), run_id="probe-closed",
                                 allowed_peers=(peer_id_of_identity(identity),))
    closed.write_json(tmp_path / "closed.json")
    proc, maddr = start_node(tmp_path, "closed", tmp_path / "closed.json", "--identity", str(identity))
    try:
        done = run_probe(probe_env, maddr)
    finally:
        stop(proc)
    assert done.returncode == 1
    assert verdict(done).startswith(
        "refused: the node closed the stream unanswered: the run is closed to this peer"
    )
    assert "lists /swarm-node/status/1.0.0: yes" in done.stdout  # libp2p itself still answered
