"""A bootstrap and volunteers on test-bed hosts, started the way people start them: the
host runs `swarm-bootstrap`, every volunteer types the line it printed. Waits poll for
a condition with a deadline, never sleep for a guessed time."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from netbed import Host, TestBed, host_env
from polling import wait_for as _wait_for
from shared_machine import COMPUTE_SHARE

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # swarm-node and swarm-bootstrap are on the PATH as installed
EXAMPLE_SPEC = REPO / "examples" / "debug-synthetic.toml"
HTTP_PORT = 8080
# What net/guard.py logs about a peer it ignores, bans, or refuses at the stream gate.
GUARD_LINE = re.compile(r"^.*(?:ignoring peer|banning peer|not admitted).*$", re.MULTILINE)


def volunteer_env(**extra: str) -> dict[str, str]:
    return host_env(PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", **extra)


def run_spec_file(workdir: Path, inner_steps: int = 20, run_id: str = "multihost") -> Path:
    """The example run with shorter rounds, so that a test sees several of them."""
    text = EXAMPLE_SPEC.read_text()
    text = re.sub(r"(?m)^inner_steps = \d+", f"inner_steps = {inner_steps}", text)
    text = re.sub(r'(?m)^run_id = "[^"]*"', f'run_id = "{run_id}"', text)
    path = workdir / f"{run_id}.toml"
    path.write_text(text)
    return path


def wait_for(condition, timeout_s: float, what: str, logs: Path | None = None):
    """Polls every half second: a poll is often an HTTP request made from another host."""
    return _wait_for(condition, timeout_s, what, logs, interval_s=0.5)


class BootstrapOnHost:
    """`swarm-bootstrap` on a host of its own, with the defaults a host would use."""

    def __init__(self, bed: TestBed, host: Host, workdir: Path, *args: str, name: str = "bootstrap"):
        self.bed, self.host, self.workdir, self.args, self.name = bed, host, workdir, args, name
        self.identity = workdir / f"{name}.key"
        self.log = workdir / f"{name}.log"
        self.process = None
        self.start()

    def start(self) -> None:
        self.log.write_text("")
        argv = [str(VENV_BIN / "swarm-bootstrap"), "--identity", str(self.identity), "--http-port",
                str(HTTP_PORT),
                *self.args]
        self.process = self.bed.popen(self.host, argv, cwd=self.workdir, env=volunteer_env(), log=self.log)

    def join_line(self, timeout_s: float = 60) -> str:
        """The line it prints for volunteers, exactly."""
        def printed():
            assert self.process.poll() is None, f"bootstrap exited: {self.log.read_text()[-3000:]}"
            lines = [ln.strip() for ln in self.log.read_text().splitlines()]
            return next((ln for ln in lines if ln.startswith("swarm-node join --initial-peers")), None)

        return wait_for(printed, timeout_s, "the bootstrap to print the join line", self.log)

    @property
    def maddr(self) -> str:
        return self.join_line().split()[-1]

    @property
    def peer_id(self) -> str:
        return self.maddr.rsplit("/p2p/", 1)[1]

    def get(self, path: str) -> tuple[int, bytes]:
        def fetch():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}{path}", timeout=10) as reply:
                    return reply.status, reply.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except OSError as exc:  # not listening (yet, or any more)
                return 0, str(exc).encode()

        return self.bed.call(self.host, fetch, timeout_s=30)

    def status(self) -> dict | None:
        code, body = self.get("/api/status")
        return json.loads(body) if code == 200 else None

    def peers(self) -> list[dict]:
        status = self.status()
        return [p for stage in status["stages"] for p in stage["peers"]] if status else []


class Volunteer:
    """`swarm-node join` typed on a host of its own: the bootstrap's line, plus a compute
    share (tests/shared_machine.py) and ``extra``; ``full_speed`` leaves the share out,
    for a benchmark, whose nodes must compute as a volunteer's would."""

    def __init__(self, bed: TestBed, host: Host, workdir: Path, line: str, *extra: str,
                 full_speed: bool = False):
        self.bed, self.host = bed, host
        self.workdir = workdir / host.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = self.workdir / "join.log"
        self.command = " ".join([line, *map(shlex.quote, (*(() if full_speed else COMPUTE_SHARE), *extra))])
        self.start()

    def start(self) -> None:
        """(Again, after a kill: the same command on the same host, as a volunteer would.)
        Each host has a disk of its own: the node's caches (a run's fetched dataset)."""
        with open(self.log, "a"):
            pass
        self.process = self.bed.popen(self.host, ["bash", "-c", self.command], cwd=self.workdir,
                                      env=volunteer_env(XDG_CACHE_HOME=str(self.workdir / "cache")),
                                      log=self.log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def peer_id(self) -> str | None:
        found = re.search(r"node (\w+): stage (\d+) of", self.text())
        return found.group(1) if found else None

    def status(self, port: int) -> dict | None:
        """The node's own /api/status (it was started with ``--http-port port``), asked
        from its host, once it trains (None before)."""
        def fetch():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as reply:
                    return json.loads(reply.read())
            except OSError:
                return None

        status = self.bed.call(self.host, fetch, timeout_s=30)
        training = status and status.get("stage") is not None and status["state"] == "training"
        return status if training else None

    def metrics(self) -> list[dict]:
        """The JSON lines the node wrote after each outer round (and at exit)."""
        return [json.loads(line) for path in sorted((self.workdir / "runs").glob("*/metrics-*.jsonl"))
                for line in path.read_text().splitlines() if line.strip()]


def guard_lines(boot: BootstrapOnHost, volunteers: list[Volunteer]) -> dict[str, list[str]]:
    """Every guard line (GUARD_LINE) in each volunteer's log and the bootstrap's, by host."""
    lines = {v.host.name: GUARD_LINE.findall(v.text()) for v in volunteers}
    lines["boot"] = GUARD_LINE.findall(boot.log.read_text(errors="replace"))
    return lines


def two_by_two(bed: TestBed, workdir: Path, run_id: str) -> tuple[BootstrapOnHost, list[Volunteer]]:
    """A bootstrap and four volunteers on hosts of their own, returned once all four have
    averaged with a partner and answered the bootstrap (verified)."""
    spec = run_spec_file(workdir, run_id=run_id)
    boot = BootstrapOnHost(bed, bed.add_host("boot"), workdir, "--run-spec", str(spec))
    line = boot.join_line()
    volunteers = [Volunteer(bed, bed.add_host(f"v{i}"), workdir, line) for i in range(4)]

    def trained():
        peers = boot.peers()
        return len(peers) == 4 and all(p["partner_rounds"] >= 1 and p["verified"] for p in peers)

    wait_for(trained, 300, "the 2 x 2 run to train", workdir)
    return boot, volunteers


def measure_window(boot: BootstrapOnHost, seconds: float) -> tuple[float, int]:
    """(tokens/s, micro-batches lost) of the swarm over the next ``seconds``, as the
    bootstrap counts them (verified peers only). A measurement, not a wait for anything."""
    def lost() -> int:
        return sum(p["microbatches_lost"] for p in boot.peers() if p["verified"])

    tokens, lost_before, started = boot.status()["tokens"], lost(), time.monotonic()
    time.sleep(seconds)
    return (boot.status()["tokens"] - tokens) / (time.monotonic() - started), lost() - lost_before
