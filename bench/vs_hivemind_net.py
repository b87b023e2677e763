"""A sandbox for one swarm: its own network namespace (loopback only) and its own /tmp.

Every process of the swarm runs inside, so the namespace's loopback counters see all
the bytes its peers send each other (payloads, DHT, libp2p and TCP/IP headers) and
nothing from anyone else on the machine. The private /tmp keeps hivemind's daemon
sockets apart: other swarms on this machine clean up "stale" sockets by looking at the
sockets bound in *their* network namespace, which would otherwise include ours.

Needs root and iproute2; ``Sandbox.available()`` says whether they are here. Names
carry the prefix ``sbe-``; the namespace is deleted on exit, also after errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

PREFIX = "sbe-"


class Sandbox:
    def __init__(self, label: str):
        self.name = f"{PREFIX}{label}-{uuid.uuid4().hex[:6]}"
        self.tmp_dir: Path | None = None

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("mount") is not None

    def __enter__(self) -> "Sandbox":
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-tmp-"))
        try:
            _ip("netns", "add", self.name)
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._kill_leftovers()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Only our processes live in this namespace; none may outlive it (a node whose
        parent was killed hard would otherwise keep running)."""
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside: ``ip netns exec`` gives it a mount namespace of its own,
        in which our directory is bound over /tmp before ``cmd`` replaces the shell."""
        return ["ip", "netns", "exec", self.name, "sh", "-c", 'mount --bind "$0" /tmp && exec "$@"',
                str(self.tmp_dir), *cmd]

    def tx_bytes(self) -> int:
        """Bytes sent on the namespace's loopback so far (every packet once, headers included)."""
        out = _ip("-n", self.name, "-s", "-j", "link", "show", "lo")
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout
