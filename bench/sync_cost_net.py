"""Network namespaces for the sync-cost benchmark: one namespace per peer, all joined by
one bridge, each peer's link shaped by ``tc tbf`` in both directions.

    root namespace:  sba-br (bridge) -- sba-v<i> (veth, egress = peer i's download)
    namespace sba-p<i>:              sba-c<i> (veth, egress = peer i's upload), 10.77.0.<i+1>/24

Needs root and iproute2; ``tc netem`` is missing on these machines, so links have a
bandwidth limit but no added latency. Everything is named with the ``sba-`` prefix and
removed by ``close()`` (deleting a namespace also deletes the veth end inside it, and
with it its partner)."""

from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "sba-"
BRIDGE = f"{PREFIX}br"
SUBNET = "10.77.0"


def namespace(rank: int) -> str:
    return f"{PREFIX}p{rank}"


def host_address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def outer_link(rank: int) -> str:
    return f"{PREFIX}v{rank}"


def inner_link(rank: int) -> str:
    return f"{PREFIX}c{rank}"


def available() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def tbf_args(rate_mbit: float) -> list[str]:
    """A token bucket of ``rate_mbit``: a burst of 10 ms of traffic (at least 64 KiB, so
    the kernel timer can keep up) and at most 50 ms of queue."""
    burst_bytes = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes), "latency", "50ms"]


def setup_commands(num_peers: int) -> list[list[str]]:
    cmds = [["ip", "link", "add", BRIDGE, "type", "bridge"], ["ip", "link", "set", BRIDGE, "up"]]
    for rank in range(num_peers):
        ns, outer, inner = namespace(rank), outer_link(rank), inner_link(rank)
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
                 ["ip", "link", "set", inner, "netns", ns],
                 ["ip", "link", "set", outer, "master", BRIDGE],
                 ["ip", "link", "set", outer, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{host_address(rank)}/24", "dev", inner],
                 ["ip", "-n", ns, "link", "set", inner, "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"]]
    return cmds


def shape_commands(num_peers: int, rate_mbit: float) -> list[list[str]]:
    """Replace the qdisc on both ends of every peer's veth: upload and download each
    get ``rate_mbit``, like a symmetric access link."""
    cmds = []
    for rank in range(num_peers):
        cmds.append(["tc", "-n", namespace(rank), "qdisc", "replace", "dev", inner_link(rank), "root",
                     *tbf_args(rate_mbit)])
        cmds.append(["tc", "qdisc", "replace", "dev", outer_link(rank), "root", *tbf_args(rate_mbit)])
    return cmds


def teardown_commands(num_peers: int) -> list[list[str]]:
    cmds = [["ip", "netns", "del", namespace(rank)] for rank in range(num_peers)]
    cmds += [["ip", "link", "del", outer_link(rank)] for rank in range(num_peers)]
    return cmds + [["ip", "link", "del", BRIDGE]]


class Namespaces:
    """Creates the namespaces on entry and removes every one of them on exit, errors included."""

    def __init__(self, num_peers: int):
        self.num_peers = num_peers

    def __enter__(self) -> "Namespaces":
        self.close()  # leftovers of a run that was killed before its clean-up (our names only)
        try:
            for cmd in setup_commands(self.num_peers):
                subprocess.run(cmd, check=True, capture_output=True, text=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shape(self, rate_mbit: float) -> None:
        for cmd in shape_commands(self.num_peers, rate_mbit):
            subprocess.run(cmd, check=True, capture_output=True, text=True)

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", namespace(rank)]

    def close(self) -> None:
        # Each step may find its object gone already (a deleted namespace takes its veth
        # pair with it): failures here are expected and ignored.
        for cmd in teardown_commands(self.num_peers):
            subprocess.run(cmd, check=False, capture_output=True)
