"""The options of a peer on the network that `swarm-node join` and `swarm-bootstrap` both
have, each declared here once with one help text; what differs between a volunteer's
node and a run's bootstrap (default port, who may read the status server, what the
initial peers are) is a parameter the program passes. Also the program-wide -v and
--version of both programs."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node import __version__
from swarm_node.cli.args import port_number

Parser = argparse.ArgumentParser


def version(p: Parser, *, program: str) -> None:
    p.add_argument("--version", action="version", version=f"{program} {__version__}")


def verbose(p: Parser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def initial_peers(p: Parser, *, bootstrap: bool) -> None:
    """``bootstrap``: a bootstrap's initial peers are the run's other bootstraps."""
    which = ("other bootstraps (or nodes) of the same run: several bootstraps avoid a single point of failure"
             if bootstrap else "the bootstrap's, as it prints them")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help=f"multiaddrs of peers already in the swarm, ending in /p2p/<peer id>: {which}")


def run_id(p: Parser, *, serve: bool) -> None:
    """``serve``: the bootstrap serves a published run, a node joins one."""
    what = ("with --initial-peers and no --run-spec: which published run to serve" if serve else
            "which run to join when the initial peers publish several")
    p.add_argument("--run-id", default=None, help=f"{what} (default: the only one published)")


def identity(p: Parser, *, default: Path | None) -> None:
    """``default``: the bootstrap's fixed file, since volunteers dial its peer id; a node
    without one takes a new identity each start."""
    shown = str(default).replace("%", "%%") if default else "a new identity each start"
    p.add_argument("--identity", type=Path, default=default, metavar="FILE",
                   help="private key file, created on first use: keeps the peer id (and so the multiaddrs) "
                        f"across restarts (back it up, never commit it); default: {shown}")


def listen(p: Parser, *, port: int, bootstrap: bool) -> None:
    """Where the peer listens (``port`` its default) and what it announces. The bootstrap
    takes --port as given (None when not) and checks it itself: it refuses --port with
    --host-maddrs, and its message names its default."""
    unreachable = ("else only machines on your network can join" if bootstrap
                   else "or the node runs as stage 0 only")
    p.add_argument("--port", type=int if bootstrap else port_number, default=None if bootstrap else port,
                   help=f"TCP port of libp2p, on every interface, instead of --host-maddrs (0: any free "
                        f"port; default: {port}); with --public-ip also the port announced. Others must be "
                        f"able to reach it: forward it on your router, {unreachable}")
    p.add_argument("--public-ip", default=None, metavar="IP",
                   help="announce this address with --port instead of the interfaces' own: your router's "
                        "public IP when you forwarded the port")
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                   help="where to listen, as multiaddrs, instead of --port, e.g. /ip4/127.0.0.1/tcp/0 "
                        "(default: /ip4/0.0.0.0/tcp/PORT with --port's PORT)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="what to tell others to dial, instead of --public-ip, e.g. "
                        "/dns4/node.example.org/tcp/31338 or /ip4/PUBLIC_IP/tcp/PORT")


def status_server(p: Parser, *, bootstrap: bool) -> None:
    """The bootstrap's status server is the run's public dashboard: on by default, on
    every interface (it checks the port itself, as --port). A node's status is its
    owner's: off unless asked for, on this machine only."""
    dashboard = "the dashboard (/), " if bootstrap else ""
    p.add_argument("--http-port", type=int if bootstrap else port_number, default=8080 if bootstrap else None,
                   metavar="PORT",
                   help=f"serve {dashboard}/healthz, /metrics (Prometheus) and /api/status on this port "
                        f"(0: any free port; default: {'%(default)s' if bootstrap else 'no status server'})")
    p.add_argument("--http-host", default="0.0.0.0" if bootstrap else "127.0.0.1", metavar="IP",
                   help="interface of the status server: 127.0.0.1 this machine only, 0.0.0.0 every "
                        "interface (containers give it); default: %(default)s")


def startup_timeout(p: Parser, *, default: float) -> None:
    p.add_argument("--startup-timeout", type=float, default=default, metavar="SECONDS",
                   help="seconds for the libp2p daemon and the DHT to start and reach an initial peer; one "
                        "that accepts connections but does not answer (busy) is retried until then; "
                        "default: %(default)s")
