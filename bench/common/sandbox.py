"""A sandbox for one swarm: its own network namespace (loopback only).

Every process of the swarm runs inside, so the namespace's loopback counters see all
the bytes its peers send each other (payloads, DHT, libp2p and TCP/IP headers) and
nothing from anyone else on the machine. The daemons' unix sockets live in the shared
/tmp (hivemind hard-codes it); those the swarm leaves behind are removed on exit. (An
earlier version bound a private directory over /tmp, which hid a checkout under /tmp,
and its own virtual environment, from the swarm's processes.)

Needs root and iproute2; ``Sandbox.available()`` says whether they are here. Names
carry the prefix ``sbe-``; the namespace is deleted on exit, also after errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

from swarm_node.local.swarm import daemon_sockets, remove_stale_sockets

PREFIX = "sbe-"


class Sandbox:
    def __init__(self, label: str):
        self.name = f"{PREFIX}{label}-{uuid.uuid4().hex[:6]}"
        self._sockets_before: set[Path] = set()

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("ip") is not None

    def __enter__(self) -> Sandbox:
        self._sockets_before = daemon_sockets()
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
        remove_stale_sockets(self._sockets_before)

    def _kill_leftovers(self) -> None:
        """Only our processes live in this namespace; none may outlive it (a node whose
        parent was killed hard would otherwise keep running)."""
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def tx_bytes(self) -> int:
        """Bytes sent on the namespace's loopback so far (every packet once, headers included)."""
        out = _ip("-n", self.name, "-s", "-j", "link", "show", "lo")
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout
