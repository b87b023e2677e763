"""Helpers for multi-process swarm tests on loopback: a bootstrap DHT in the test
process and real ``swarm-node join`` processes. Waiting is done by polling for a
condition with a deadline, never by sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm_node.membership.registry import read_stage
from swarm_node.net.dht import SwarmDHT
from swarm_node.spec import RunSpec
from swarm_node.wire.records import PeerRecord


class SwarmHarness:
    def __init__(self, tmp_path: Path, spec: RunSpec):
        self.tmp_path = tmp_path
        self.spec = spec
        self.spec_path = tmp_path / "run-spec.json"
        spec.write_json(self.spec_path)
        self.processes: list[subprocess.Popen] = []
        self.loop = asyncio.new_event_loop()
        self.dht = self.loop.run_until_complete(SwarmDHT.start())
        self.maddr = self.dht.visible_maddrs()[0]

    def spawn(self, stage: int, *extra: str, name: str, program: tuple[str, ...] = ("-m", "swarm_node"),
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """``program``: what python runs instead of swarm_node (a hostile peer built in the test)."""
        cmd = [sys.executable, *program, "join", "--initial-peers", self.maddr, "--config",
               str(self.spec_path), "--stage", str(stage), "--device", "cpu", "--threads", "1", "--run-dir",
               str(self.tmp_path), "--no-progress", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra]
        log = open(self.tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        log.close()
        self.processes.append(proc)
        return proc

    def records(self, stage: int) -> dict[str, PeerRecord]:
        records, unreadable = self.loop.run_until_complete(read_stage(self.dht, self.spec.run_id, stage))
        assert not unreadable, unreadable
        return records

    def wait_for(self, condition, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            self.loop.run_until_complete(asyncio.sleep(0.2))  # polling interval, not synchronisation
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; logs in {self.tmp_path}")

    def summary_of(self, proc: subprocess.Popen) -> dict:
        for path in self.tmp_path.glob("summary-*.json"):
            data = json.loads(path.read_text())
            if data["pid"] == proc.pid:
                return data
        raise AssertionError(f"no summary for pid {proc.pid}; logs in {self.tmp_path}")

    def log_of(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        """Stops the processes and the DHT; again (the fixture's, after the test's own), nothing."""
        if self.loop.is_closed():
            return
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.loop.run_until_complete(self.dht.shutdown())
        self.loop.close()


@pytest.fixture
def harness_factory(tmp_path):
    harnesses = []

    def make(spec: RunSpec) -> SwarmHarness:
        harness = SwarmHarness(tmp_path, spec)
        harnesses.append(harness)
        return harness

    yield make
    for h in harnesses:
        h.close()
