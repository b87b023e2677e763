"""The ``swarm-bootstrap`` command line. It only parses arguments and hands them on."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from swarm_node.cli import options, peer_options
from swarm_node.errors import ConfigError, SwarmError
from swarm_node.net.maddr import check_ip, check_maddrs

DEFAULT_IDENTITY = Path(os.environ.get("XDG_CONFIG_HOME",
                                       Path.home() / ".config")) / "swarm-node" / "bootstrap.key"
DEFAULT_PORT = 31337


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-bootstrap",
        description="Host the bootstrap peer of a swarm-node run: a DHT peer that trains nothing, publishes "
                    "the "
        "run spec, and serves a status dashboard. Prints the multiaddrs volunteers pass to "
        "`swarm-node join --initial-peers`.",
    )
    peer_options.version(p, program="swarm-bootstrap")
    peer_options.identity(p, default=DEFAULT_IDENTITY)
    p.add_argument("--run-spec", type=Path, default=None,
                   help="the run to publish (.toml or .json); required unless --initial-peers name a running "
                        "bootstrap whose run this one serves")
    peer_options.run_id(p, serve=True)
    options.data(p, served=True)
    peer_options.initial_peers(p, bootstrap=True)
    peer_options.listen(p, port=DEFAULT_PORT, bootstrap=True)
    peer_options.status_server(p, bootstrap=True)
    peer_options.startup_timeout(p, default=60.0)
    p.add_argument("--no-reachability-check", action="store_true",
                   help="skip dialling the announced addresses at start-up")
    p.add_argument(
        "--maddrs-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the multiaddrs to this file, one per line, once serving (for nodes started "
        "with `swarm-node join --initial-peers-file`, e.g. in docker compose)",
    )
    peer_options.verbose(p)
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
            raise ConfigError(
                "--public-ip needs a fixed --port (1-65535): volunteers must know it in advance"
            )
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
