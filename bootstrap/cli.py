"""The ``swarm-bootstrap`` command line. It only parses arguments and hands them on."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from swarm_node import __version__
from swarm_node.errors import ConfigError, SwarmError
from swarm_node.net.maddr import check_ip, check_maddrs

DEFAULT_IDENTITY = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "swarm-node" / "bootstrap.key"
DEFAULT_PORT = 31337


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-bootstrap",
        description="Host the bootstrap peer of a swarm-node run: a DHT peer that trains nothing, publishes the "
                    "run spec, and serves a status dashboard. Prints the multiaddrs volunteers pass to "
                    "`swarm-node join --initial-peers`.")
    p.add_argument("--version", action="version", version=f"swarm-bootstrap {__version__}")
    p.add_argument("--identity", type=Path, default=DEFAULT_IDENTITY,
                   help=f"private key file; created on first run, keeps the peer id and multiaddr across restarts "
                        f"(default {DEFAULT_IDENTITY}). Back it up; never commit it")
    p.add_argument("--run-spec", type=Path, default=None,
                   help="the run to publish (.toml or .json); required unless --initial-peers name a running "
                        "bootstrap whose run this one serves")
    p.add_argument("--run-id", default=None,
                   help="with --initial-peers and no --run-spec: which published run to serve")
    p.add_argument("--data", type=Path, default=None, metavar="DIR",
                   help="the prepared dataset the run spec names (`swarm-node data prepare --out DIR`), served "
                        "to volunteers")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="other bootstraps (or nodes) of the same run; several bootstraps avoid a single "
                        "point of failure")
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                   help=f"where to listen (default /ip4/0.0.0.0/tcp/PORT, PORT from --port: {DEFAULT_PORT})")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="the addresses volunteers should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT")
    p.add_argument("--public-ip", default=None,
                   help="shorthand: listen on every interface at --port and announce this IP with it")
    p.add_argument("--port", type=int, default=None,
                   help=f"TCP port of libp2p, on every interface (default {DEFAULT_PORT}; instead of "
                        "--host-maddrs); with --public-ip also the port announced")
    p.add_argument("--http-host", default="0.0.0.0",
                   help="address of the status server (default %(default)s: every interface)")
    p.add_argument("--http-port", type=int, default=8080,
                   help="status server port (default %(default)s; 0: any free port)")
    p.add_argument("--startup-timeout", type=float, default=60.0,
                   help="seconds for the libp2p daemon to start (default %(default)s)")
    p.add_argument("--no-reachability-check", action="store_true",
                   help="skip dialling the announced addresses at start-up")
    p.add_argument("--maddrs-file", type=Path, default=None, metavar="PATH",
                   help="also write the multiaddrs to this file, one per line, once serving (for nodes started "
                        "with `swarm-node join --initial-peers-file`, e.g. in docker compose)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _addresses(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    check_maddrs(args.host_maddrs or (), "--host-maddrs")
    check_maddrs(args.announce_maddrs, "--announce-maddrs")
    if args.port is not None and not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port: give one from 0 to 65535 "
                          f"(default {DEFAULT_PORT})")
    if args.public_ip:
        check_ip(args.public_ip, "--public-ip")
        if args.host_maddrs or args.announce_maddrs:
            raise ConfigError("use either --public-ip/--port or --host-maddrs/--announce-maddrs, not both")
        port = DEFAULT_PORT if args.port is None else args.port
        if port == 0:
            raise ConfigError("--public-ip needs a fixed --port (1-65535): volunteers must know it in advance")
        proto = "ip6" if ":" in args.public_ip else "ip4"
        any_addr = "::" if proto == "ip6" else "0.0.0.0"
        return (f"/{proto}/{any_addr}/tcp/{port}",), (f"/{proto}/{args.public_ip}/tcp/{port}",)
    if args.host_maddrs and args.port is not None:
        raise ConfigError("use either --port or --host-maddrs, not both")
    port = DEFAULT_PORT if args.port is None else args.port
    host = tuple(args.host_maddrs or (f"/ip4/0.0.0.0/tcp/{port}",))
    return host, tuple(args.announce_maddrs)


def _check_args(args: argparse.Namespace) -> None:
    """What the command line alone shows to be wrong, before the identity is created or
    a daemon started."""
    check_maddrs(args.initial_peers, "--initial-peers", peer_id=True)
    if args.run_spec is None and not args.initial_peers:
        raise ConfigError("give --run-spec RUN.toml (or --initial-peers of a running bootstrap to serve its "
                          "run)")
    if not 0 <= args.http_port < 65536:
        raise ConfigError(f"--http-port {args.http_port} is not a TCP port: give one from 0 to 65535")
    if args.data is not None:
        from swarm_node.data.manifest import MANIFEST_FILE

        if not args.data.is_dir():
            what = "is a file" if args.data.exists() else "does not exist"
            raise ConfigError(f"--data {args.data} {what}: give the folder `swarm-node data prepare "
                              "--out DIR` wrote")
        if not (args.data / MANIFEST_FILE).is_file():
            raise ConfigError(f"--data {args.data} holds no {MANIFEST_FILE}: give the folder "
                              "`swarm-node data prepare --out DIR` wrote, or run that first")


def _print_ready(ready) -> None:
    lines = [f"bootstrap peer {ready.peer_id} serving run {ready.run_id!r}",
             "volunteers join with:",
             f"  swarm-node join --initial-peers {ready.maddrs[0] if ready.maddrs else '?'}",
             "all multiaddrs of this peer:", *(f"  {m}" for m in ready.maddrs),
             f"run spec DHT key: {ready.spec_key}",
             f"dashboard: {ready.http_url}  (also /healthz, /metrics, /api/status)"]
    print("\n".join(lines), flush=True)


def _write_maddrs(path: Path, maddrs: list[str]) -> None:
    """Atomically: a reader never sees half a file."""
    from swarm_node.system import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(f"{m}\n" for m in maddrs))


def main(argv: list[str] | None = None) -> int:
    from swarm_bootstrap.identity_policy import prepare_identity
    from swarm_bootstrap.peer import BootstrapConfig, BootstrapPeer

    from swarm_node.obs.logs import setup_logging
    from swarm_node.spec import RunSpec
    from swarm_node.system import run_on_fast_loop

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        host, announce = _addresses(args)
        _check_args(args)
        run_spec = RunSpec.from_file(args.run_spec) if args.run_spec else None
        prepare_identity(args.identity)
        config = BootstrapConfig(identity_path=args.identity, host_maddrs=host, announce_maddrs=announce,
                                 initial_peers=tuple(args.initial_peers), run_spec=run_spec,
                                 run_id=args.run_id, http_host=args.http_host, http_port=args.http_port,
                                 startup_timeout_s=args.startup_timeout,
                                 check_reachability=not args.no_reachability_check, data_dir=args.data)
        def on_ready(ready) -> None:
            _print_ready(ready)
            if args.maddrs_file is not None:
                _write_maddrs(args.maddrs_file, ready.maddrs)

        run_on_fast_loop(BootstrapPeer(config, on_ready=on_ready).run())
        return 0
    except (ValueError, OSError, SwarmError) as exc:
        print(f"swarm-bootstrap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
