"""A multi-host test bed on one machine: every host is a network namespace.

    namespace PREFIX-wan        bridge br0: "the internet", 10.201.0.0/24
      port pN  <-- access link -->  namespace PREFIX-NAME   eth0 10.201.0.(10+N)   (a public host)
      port pN  <-- access link -->  namespace PREFIX-NAME-nat  wan0 10.201.0.(10+N)  (a home router)
                                        lan0 192.168.1.1  <- veth ->  namespace PREFIX-NAME  eth0 192.168.1.2

An access link is a veth pair, or, when the host asks for latency, a pair of TAP devices
joined by ``delay.py`` (``tc netem`` is missing here). Rates are ``tc tbf`` on both ends of
the access link (the host's upload and its download). A host behind NAT sits on a private
LAN behind a router namespace that masquerades its traffic (iptables), so it can dial out
but nobody can dial in: what a volunteer's home connection does.

Addresses come from private ranges and exist only inside these namespaces. Everything is
named ``snb-<pid>-...``; ``close()`` removes it all (processes first), also after failures,
and a new bed first removes what a killed test run left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .netns import call_in

PREFIX = "snb"
WAN_SUBNET = "10.201.0"
LAN_SUBNET = "192.168.1"
QUEUE_MS = 50.0  # a shaped link's queue, unless a host asks for another
JUMBO_MTU = 9000  # fewer, larger frames for the userspace delay stage; the same on every link
DELAY_PROGRAM = Path(__file__).with_name("delay.py")
LEFTOVER = re.compile(rf"^{PREFIX}-(\d+)-")


@dataclass
class Host:
    name: str
    namespace: str
    address: str  # its own interface address
    public_address: str  # what other hosts see and can reach: the router's address behind a NAT
    behind_nat: bool
    rate_mbit: float | None
    rtt_ms: float
    router: str | None = None  # the router's namespace, behind a NAT
    port: str = ""  # its access link's end on the bridge

    @property
    def edge(self) -> tuple[str, str]:
        """(namespace, device) of the access link's end on the host's side."""
        return (self.router, "wan0") if self.router else (self.namespace, "eth0")
    processes: list[subprocess.Popen] = field(default_factory=list)


def unavailable() -> str | None:
    """Why a test bed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the multi-host test bed needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    if not Path("/dev/net/tun").exists():
        return "the multi-host test bed needs /dev/net/tun for links with latency"
    return None


def ensure_iptables() -> str | None:
    """iptables for the NAT router, installed with apt-get where missing (as root); returns
    why it cannot be had, or None."""
    if shutil.which("iptables") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "iptables"]
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
    if shutil.which("iptables") is None:
        return "iptables is missing and could not be installed (apt-get install iptables, as root)"
    return None


def remove_leftovers() -> None:
    """Namespaces of beds whose test process is gone (killed before its clean-up)."""
    for name in _namespaces():
        match = LEFTOVER.match(name)
        if match and not _alive(int(match.group(1))):
            _delete_namespace(name)


class ClosedOnFailure:
    """A context manager built by ``open()`` and taken down by ``close()``; a failure half
    way through ``open()`` still closes what was built (namespaces, processes)."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TestBed(ClosedOnFailure):
    """``with TestBed() as bed: boot = bed.add_host("boot"); bed.popen(boot, [...])``."""

    __test__ = False  # not a pytest test class

    def __init__(self, label: str = "t", mtu: int = JUMBO_MTU):
        self.prefix = f"{PREFIX}-{os.getpid()}-{label}"
        self.mtu = mtu
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._relays: list[subprocess.Popen] = []
        self._next_index = 0
        self.wan = f"{self.prefix}-wan"

    # -- building ------------------------------------------------------------------
    def __enter__(self) -> TestBed:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        remove_leftovers()
        return super().__enter__()

    def open(self) -> None:
        self._add_namespace(self.wan)
        _ip(self.wan, "link", "add", "br0", "type", "bridge")
        _ip(self.wan, "link", "set", "br0", "mtu", str(self.mtu), "up")

    def add_host(self, name: str, *, rate_mbit: float | None = None, rtt_ms: float = 0.0,
                 behind_nat: bool = False, queue_ms: float = QUEUE_MS) -> Host:
        """A host on the internet (or behind a home router with ``behind_nat``) whose access
        link has ``rate_mbit`` each way, queueing up to ``queue_ms`` (a home router's
        buffer holds hundreds), and adds ``rtt_ms`` to every round trip through it (so two
        hosts with 20 ms each see 40 ms between them)."""
        if name in self.hosts or not re.fullmatch(r"[a-z0-9]{1,8}", name):
            raise ValueError(f"host names are unique, 1-8 lowercase letters or digits: {name!r}")
        if behind_nat and (reason := ensure_iptables()):
            raise RuntimeError(reason)
        index = self._next_index
        self._next_index += 1
        public = f"{WAN_SUBNET}.{10 + index}"
        namespace = f"{self.prefix}-{name}"
        host = Host(name, namespace, LAN_SUBNET + ".2" if behind_nat else public, public, behind_nat,
                    rate_mbit,
                    rtt_ms, router=f"{namespace}-nat" if behind_nat else None, port=f"p{index}")
        try:
            self._add_namespace(namespace)
            if behind_nat:
                self._add_namespace(host.router)
            edge, edge_dev = host.edge  # the side that faces the internet
            self._access_link(edge, edge_dev, host.port, rtt_ms)
            _ip(edge, "addr", "add", f"{public}/24", "dev", edge_dev)
            _ip(edge, "link", "set", edge_dev, "mtu", str(self.mtu), "up")
            if behind_nat:
                self._home_router(host)
            if rate_mbit is not None:
                self.shape(host, rate_mbit, queue_ms)
        except BaseException:
            self.close()
            raise
        self.hosts[name] = host
        return host

    def tx_bytes(self, host: Host) -> int:
        """Bytes the host has sent into its access link: everything (payloads, DHT,
        libp2p and TCP/IP headers), the same count for any program."""
        return self.link_bytes(host)[0]

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """Bytes the host has sent into its access link and received from it, so far."""
        edge, edge_dev = host.edge
        shown = subprocess.run(["ip", "-n", edge, "-s", "-j", "link", "show", "dev", edge_dev],
                               capture_output=True,
                               text=True, check=True, timeout=30).stdout
        stats = json.loads(shown)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def shape(self, host: Host, rate_mbit: float, queue_ms: float = QUEUE_MS) -> None:
        """Upload and download of the host's access link, each ``rate_mbit``."""
        edge, edge_dev = host.edge
        for namespace, device in ((edge, edge_dev), (self.wan, host.port)):
            _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root",
                  *tbf_args(rate_mbit, queue_ms)])
        host.rate_mbit = rate_mbit

    def _add_namespace(self, namespace: str) -> None:
        _run(["ip", "netns", "add", namespace])
        self._namespaces.append(namespace)
        _ip(namespace, "link", "set", "lo", "up")

    def _access_link(self, edge: str, edge_dev: str, port: str, rtt_ms: float) -> None:
        if rtt_ms > 0:
            _ip(edge, "tuntap", "add", "dev", edge_dev, "mode", "tap")
            _ip(self.wan, "tuntap", "add", "dev", port, "mode", "tap")
            self._start_relay(f"{edge}:{edge_dev}:{self.wan}:{port}:{rtt_ms / 2}:{rtt_ms / 2}")
        else:
            _ip(self.wan, "link", "add", port, "type", "veth", "peer", "name", edge_dev, "netns", edge)
        _ip(self.wan, "link", "set", port, "master", "br0")
        _ip(self.wan, "link", "set", port, "mtu", str(self.mtu), "up")

    def _home_router(self, host: Host) -> None:
        router = host.router
        _ip(router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip(router, "addr", "add", f"{LAN_SUBNET}.1/24", "dev", "lan0")
        _ip(router, "link", "set", "lan0", "mtu", str(self.mtu), "up")
        _ip(host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip(host.namespace, "link", "set", "eth0", "mtu", str(self.mtu), "up")
        _ip(host.namespace, "route", "add", "default", "via", f"{LAN_SUBNET}.1")
        _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _run(["ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0",
              "-j", "MASQUERADE"])

    def _start_relay(self, link: str) -> None:
        """One delay process per link keeps a slow link from delaying another's frames."""
        relay = subprocess.Popen([sys.executable, str(DELAY_PROGRAM), link], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._relays.append(relay)
        line = relay.stdout.readline()  # "ready" once both TAP devices are attached
        if line.strip() != "ready":
            raise RuntimeError(f"the delay stage did not start: {line}{relay.stderr.read()}")

    # -- running things on hosts ----------------------------------------------------
    def popen(self, host: Host, argv: Sequence[str], *, cwd: Path | None = None, env: dict | None = None,
              log: Path | None = None) -> subprocess.Popen:
        """``argv`` on ``host``, in a session of its own (stopped with its children)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            process = subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], cwd=cwd,
                                       env=env if env is not None else host_env(), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()
        host.processes.append(process)
        return process

    def call(self, host: Host, fn: Callable, *args, timeout_s: float = 60.0, **kwargs):
        """``fn`` run in this process, with its sockets on ``host``."""
        return call_in(host.namespace, fn, *args, timeout_s=timeout_s, **kwargs)

    def rtt_ms_between(self, a: Host, b: Host) -> float:
        return a.rtt_ms + b.rtt_ms

    # -- tearing down ----------------------------------------------------------------
    def stop_processes(self, *hosts: Host, grace_s: float = 30.0) -> None:
        """SIGTERM to every process of ``hosts`` at once, then wait for each (SIGKILL
        after ``grace_s``): shutting down one after the other would add up their graces."""
        processes = [p for host in hosts for p in host.processes]
        for process in processes:
            if process.poll() is None:
                _signal_group(process.pid, signal.SIGTERM)
        for process in processes:
            stop(process, grace_s)

    def close(self) -> None:
        self.stop_processes(*self.hosts.values(), grace_s=10.0)
        for namespace in reversed(self._namespaces):
            _delete_namespace(namespace)  # kills whatever still runs inside first
        self._namespaces.clear()
        for relay in self._relays:
            stop(relay, 5.0)
        self._relays.clear()


def host_env(**extra: str) -> dict[str, str]:
    """Processes of one host act as a one-core machine: the bed's hosts share this
    machine's cores, and torch would otherwise spin one thread per core in each."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGTERM its process group, SIGKILL after ``grace_s``."""
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process.pid, signal.SIGKILL)  # children it left behind, too
    return process.wait()


def tbf_args(rate_mbit: float, queue_ms: float = QUEUE_MS) -> list[str]:
    """A token bucket: bursts of 10 ms of traffic (at least 64 KiB, so the kernel timer
    keeps up) and at most ``queue_ms`` of queue."""
    burst_bytes = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes), "latency", f"{queue_ms:g}ms"]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _delete_namespace(namespace: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline and any(_alive(int(p)) for p in pids if p.isdigit()):
        time.sleep(0.05)  # polling for the kernel to reap what we killed
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return False


def _ip(namespace: str, *args: str) -> None:
    _run(["ip", "-n", namespace, *args])


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
