"""One peer per listening port on a machine.

The libp2p daemon binds its TCP ports with SO_REUSEPORT, so a second daemon on a port
taken by one of the same user does start, and then the kernel deals the incoming
connections of either peer to both (seen: two nodes started together by one script,
one per GPU, both on 31338; the bootstrap's dial-back reached the other one, so a node
thought itself behind a NAT, dials failed with "dial to self attempted", and neither
ever trained). A bind probe alone cannot stop that: two peers started at the same
moment both pass it before either daemon binds.

So a peer first claims each fixed port it will listen on (``claim_ports``): on Linux it
binds the abstract Unix socket ``swarm-node/tcp-port/<N>``, which exists once per
network namespace, as TCP ports do (peers in network namespaces of their own, as the
test bed runs them, each have their own 31338), and which the kernel frees when its
holder is gone, kill -9 included. Elsewhere an exclusive flock on
``<tmp>/swarm-node-<uid>/tcp-port-<N>.lock`` does the same. Only then does it probe
the ports with a bind (another program, or a daemon still alive after its node was
killed, holds no claim) and start its daemon. Port 0 (any free port) is never claimed:
the kernel gives every daemon a port of its own.

A claim is held by the process that took it, until the peer shuts down. A child it
forks lets go of every claim at once: hivemind forks a DHT process for each peer, and
that of a second peer of the same process (as in tests) kept the first one's port
claimed after the first had shut down. A daemon that outlives its killed node for a
moment (until the node's reaper stops it) still fails the probe."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from swarm_node.errors import ConfigError

FIX_IT = "pass --port with a free port (and forward that one if this machine is behind a router)"
_HELD: set = set()  # the sockets and lock files of every claim of this process


def _let_go_in_child() -> None:
    """In a forked child: the claims stay with the process that took them."""
    for handle in _HELD:
        handle.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


def listen_ports(host_maddrs: Sequence[str]) -> list[int]:
    """The fixed TCP ports of /ip4|ip6/ADDR/tcp/PORT multiaddrs, each once (not 0)."""
    return sorted({port for *_, port in _tcp_listen_addresses(host_maddrs) if port != 0})


def _tcp_listen_addresses(host_maddrs: Sequence[str]) -> list[tuple[str, str, str, int]]:
    """(multiaddr, ip4|ip6, address, port) of each TCP multiaddr to listen on."""
    found = []
    for text in host_maddrs:
        parts = text.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[3].isdigit():
            if int(parts[3]) >= 65536:  # bind() would raise OverflowError
                raise ConfigError(f"cannot listen on {text}: {parts[3]} is not a TCP port (0-65535)")
            found.append((text, parts[0], parts[1], int(parts[3])))
    return found


class PortClaim:
    """The ports this peer has claimed; ``release`` gives them back (and is idempotent)."""

    def __init__(self, ports: Sequence[int] = ()):
        self.ports = tuple(ports)
        self._handles: list = []  # sockets or lock files: closing the last copy frees the port

    def release(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            _HELD.discard(handle)
            handle.close()


def claim_ports(host_maddrs: Sequence[str], abstract: bool | None = None) -> PortClaim:
    """Claim every fixed port of ``host_maddrs``, then check that nothing else listens
    there; a ConfigError says which port is taken. ``abstract``: whether to use the
    abstract socket (default: on Linux), else the lock file."""
    ports = listen_ports(host_maddrs)
    claim = PortClaim(ports)
    try:
        for port in ports:
            handle = _claim(port, sys.platform.startswith("linux") if abstract is None else abstract)
            if handle is None:
                raise ConfigError(
                    f"TCP port {port} is in use (another swarm-node on this machine is starting "
                    f"or running there): {FIX_IT}"
                )
            claim._handles.append(handle)
            _HELD.add(handle)
        refuse_taken_ports(host_maddrs)
    except BaseException:
        claim.release()
        raise
    return claim


def _claim(port: int, abstract: bool):
    """A handle that holds ``port`` until it is closed, or None when another holds it."""
    if abstract:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inherited by exec'd programs
        try:
            sock.bind(f"\0swarm-node/tcp-port/{port}")
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return None
            # no abstract sockets here (a sandbox that forbids them): the lock file instead
    folder = Path(tempfile.gettempdir()) / f"swarm-node-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.is_symlink() or folder.stat().st_uid != os.getuid():
        raise ConfigError(f"{folder} belongs to another user: remove it, or set TMPDIR to a folder of yours")
    lock = open(folder / f"tcp-port-{port}.lock", "a")  # held open until the claim is released
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return lock
    except BlockingIOError:
        lock.close()
        return None


def refuse_taken_ports(host_maddrs: Sequence[str]) -> None:
    """A fixed port another program listens on: say so now. (The daemon binds with
    SO_REUSEPORT, so a second one on the same port may even start, and then the kernel
    deals connections for either peer to both.)"""
    for text, proto, address, port in _tcp_listen_addresses(host_maddrs):
        if port == 0:
            continue
        family = socket.AF_INET6 if proto == "ip6" else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no owner
            try:
                probe.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"TCP port {port} is in use (another node or program on this machine?): {FIX_IT}"
                    ) from None
                raise ConfigError(f"cannot listen on {text}: {exc.strerror}") from None
