"""A real ``swarm-bootstrap`` process and ``swarm-node join`` processes that are given
nothing but the bootstrap's multiaddr. Waits poll for a condition with a deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from polling import wait_for
from shared_machine import COMPUTE_SHARE

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPEC = REPO / "examples" / "debug-synthetic.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


class Bootstrap:
    """``python -m swarm_bootstrap``; ``ready`` holds what it printed for volunteers."""

    def __init__(self, workdir: Path, identity: Path, p2p_port: int, *extra: str, name: str = "bootstrap"):
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        cmd = [sys.executable, "-m", "swarm_bootstrap", "--identity", str(identity), "--host-maddrs",
               f"/ip4/127.0.0.1/tcp/{p2p_port}", "--http-host", "127.0.0.1", "--http-port", "0", *extra]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        self.started = time.monotonic()
        self.maddr, self.url = None, None

    def wait_ready(self, timeout_s: float = 60) -> float:
        """Seconds until it printed its multiaddr and dashboard URL. The bound is for a
        hung start, not a speed target: a start takes 4 s on an idle 2-core machine, and a
        restart under a fully loaded one once took over 20 s before its first line."""
        def printed():
            assert self.process.poll() is None, f"bootstrap exited: {self.err_path.read_text()[-2000:]}"
            lines = self.out_path.read_text().splitlines()
            joins = [
                ln.split()[-1] for ln in lines if ln.strip().startswith("swarm-node join --initial-peers")
            ]
            urls = [ln.split()[1] for ln in lines if ln.startswith("dashboard: ")]
            return (joins[0], urls[0]) if joins and urls else None

        self.maddr, self.url = wait_for(printed, timeout_s, "the bootstrap to print its address",
                                        self.err_path)
        return time.monotonic() - self.started

    @property
    def peer_id(self) -> str:
        return self.maddr.rsplit("/p2p/", 1)[1]

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url.rstrip("/") + path, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def status(self) -> dict:
        code, body = self.get("/api/status")
        assert code == 200, body
        return json.loads(body)


def join(workdir: Path, name: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "swarm_node", "join", *COMPUTE_SHARE, *args]
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log.close()
    return proc
