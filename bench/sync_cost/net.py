"""Network namespaces for the sync-cost benchmark: the project's multi-host test bed
(tests/netbed), one host per peer on one bridge, every access link shaped by ``tc tbf``
in both directions (upload and download each get the rate, like a symmetric access
link). Links keep the usual 1500-byte MTU, as the benchmark's earlier results did.
Needs root and iproute2; everything is removed on exit, errors included."""

from __future__ import annotations

from tests.netbed import ClosedOnFailure, TestBed, unavailable

ETHERNET_MTU = 1500


def available() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    return unavailable()


class Namespaces(ClosedOnFailure):
    """``num_peers`` hosts of a test bed, built on entry and removed on exit."""

    def __init__(self, num_peers: int):
        self.num_peers = num_peers
        self.bed: TestBed | None = None
        self.hosts = []

    def open(self) -> None:
        self.bed = TestBed("sba", mtu=ETHERNET_MTU).__enter__()
        self.hosts = [self.bed.add_host(f"p{rank}") for rank in range(self.num_peers)]

    def shape(self, rate_mbit: float) -> None:
        for host in self.hosts:
            self.bed.shape(host, rate_mbit)

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[rank].namespace]

    def address(self, rank: int) -> str:
        return self.hosts[rank].address

    def close(self) -> None:
        if self.bed is not None:
            self.bed.close()
