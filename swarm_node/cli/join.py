"""``swarm-node join``: one node of a swarm."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.cli import options, peer_options
from swarm_node.cli.args import above_one, check_folder, port_number, positive_float, positive_int
from swarm_node.errors import ConfigError
from swarm_node.net.maddr import check_ip, check_maddrs
from swarm_node.node_config import DEFAULT_STARTUP_TIMEOUT_S
from swarm_node.obs.sinks import SINKS


def _stage(text: str) -> int | None:
    if text == "auto":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("stage must be auto or a non-negative integer")
    return value


def _shard(text: str) -> tuple[int, int]:
    try:
        shard, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SHARD/COUNT, got {text!r}") from None
    if not 0 <= shard < count:
        raise argparse.ArgumentTypeError(f"shard {shard} is outside 0..{count - 1}")
    return shard, count


DEFAULT_NODE_PORT = 31338


def add_join_parser(sub) -> None:
    p = sub.add_parser(
        "join",
        help="run one swarm node",
        description="Join a swarm as one node. With --initial-peers alone the node reads the run "
        "spec those peers publish, checks it, asks them to dial it back (can others "
        "reach it?), picks a stage, downloads state and trains.",
    )
    peer_options.initial_peers(p, bootstrap=False)
    p.add_argument("--initial-peers-file", type=Path, default=None, metavar="PATH",
                   help="read more initial peers from this file, one multiaddr per line (what "
                        "`swarm-bootstrap --maddrs-file` writes)")
    p.add_argument("--config", type=Path, default=None,
                   help="run spec (.toml or .json); optional with --initial-peers, where it must match the "
                        "published one; required to start a run without a bootstrap")
    peer_options.run_id(p, serve=False)
    p.add_argument(
        "--stage",
        type=_stage,
        default=None,
        help="auto (default: the stage with the fewest peers; stage 0 for a node others cannot reach) "
        "or a stage index",
    )
    options.device(p, default="auto")
    options.compile_stage(p)
    peer_options.listen(p, port=DEFAULT_NODE_PORT, bootstrap=False)
    p.add_argument(
        "--lane-port",
        type=port_number,
        default=0,
        help="TCP port for direct lanes, which carry activations, outer payloads and state beside libp2p "
        "at the link's speed (default: any free port; a peer that cannot reach it uses libp2p)",
    )
    options.no_lanes(p)
    peer_options.identity(p, default=None)
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many inner steps (default: train until stopped)")
    options.run_dir(p, swarm=False)
    p.add_argument("--data-shard", type=_shard, default=None, metavar="SHARD/COUNT",
                   help="stage 0: read this shard of the data (default: derived from the peer id)")
    options.data_cache(p)
    p.add_argument("--data-cache-gb", type=float, default=None, metavar="GB",
                   help="keep the fetched dataset within this many GB, evicting shards already trained "
                        "(default: no bound; stage 0 needs room for about three shards)")
    p.add_argument("--data-private-mirrors", action="store_true",
                   help="let the dataset's HTTP(S) mirrors be at loopback or private addresses (a mirror on "
                        "your own network); by default only public ones are read")
    options.round_timeout(p, default=20.0)
    peer_options.startup_timeout(p, default=DEFAULT_STARTUP_TIMEOUT_S)
    p.add_argument("--wait-for-peers", type=int, default=0, metavar="N",
                   help="stage 0: before the first micro-batch, wait (up to --startup-timeout) until this "
                        "stage (this node counted) and the next have N training peers: for nodes started "
                        "together (default: start at once)")
    p.add_argument(
        "--slowest-link-mbit",
        type=positive_float,
        default=20.0,
        metavar="MBIT_S",
        help="the slowest upload expected among peers; outer exchanges of large stages get deadlines "
        "that fit it (default %(default)s)",
    )
    options.threads(p, node=True)
    options.compute_share(p)
    p.add_argument("--no-state-download", action="store_true",
                   help="start from the run's initial weights instead of a live peer's state")
    p.add_argument(
        "--state-from",
        metavar="PEER_ID",
        default=None,
        help="ask this peer first for the stage's state (otherwise donors are picked at random); its "
        "state is still checked against the stage's other peers before it is used",
    )
    options.checkpoint_dir(p, swarm=False)
    p.add_argument("--checkpoint-every-rounds", type=positive_int, default=1, metavar="N",
                   help="write a checkpoint every N outer rounds (default %(default)s)")
    options.blocking_rounds(p)
    p.add_argument(
        "--one-payload-at-a-time",
        action="store_true",
        help="when this node sends its outer payload, fetch the partner's only afterwards, instead of "
        "both at once (for comparison: the order of outer protocol 2.0)",
    )
    p.add_argument(
        "--max-update-ratio",
        type=above_one,
        default=3.0,
        metavar="X",
        help="refuse a partner's Delta norm above X times our own recent Delta norms at our round, "
        "and do not pair with it for 30 minutes (default %(default)s; honest partners of the same "
        "round measured up to 1.3x); accepted updates count with at most 1.5x",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        choices=(*SINKS, "none"),
        default=["jsonl"],
        metavar="SINK",
        help="where training metrics go: jsonl (default), tensorboard, wandb (offline mode; upload later "
        "with `wandb sync`), or none",
    )
    p.add_argument("--metrics-dir", type=Path, default=None,
                   help="directory of the metrics (default: --run-dir, else ./runs/RUN_ID)")
    peer_options.status_server(p, bootstrap=False)
    options.no_progress(p, instead="a plain log line per minute instead (for services and log files)")
    p.set_defaults(handler=run_join)


def _listen_addresses(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(host maddrs, announce maddrs) from --port/--public-ip or the explicit multiaddrs."""
    check_maddrs(args.host_maddrs or (), "--host-maddrs")
    check_maddrs(args.announce_maddrs, "--announce-maddrs")
    if args.public_ip:
        check_ip(args.public_ip, "--public-ip")
    if args.host_maddrs:
        host = tuple(args.host_maddrs)
    else:
        host = (f"/ip4/0.0.0.0/tcp/{args.port}",)
    if args.public_ip and args.announce_maddrs:
        raise ConfigError("use either --public-ip or --announce-maddrs, not both")
    if args.public_ip:
        if args.host_maddrs or args.port == 0:
            raise ConfigError(
                "--public-ip needs a fixed --port (and no --host-maddrs): others dial that port"
            )
        proto = "ip6" if ":" in args.public_ip else "ip4"
        return host, (f"/{proto}/{args.public_ip}/tcp/{args.port}",)
    return host, tuple(args.announce_maddrs)


def _read_maddrs(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read --initial-peers-file {path}: {exc.strerror or exc}") from None
    maddrs = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not maddrs:
        raise ConfigError(f"--initial-peers-file {path} lists no multiaddr")
    return maddrs


def run_join(args: argparse.Namespace) -> int:
    from swarm_node.config import resolve_device
    from swarm_node.node.conductor import Node
    from swarm_node.node_config import NodeConfig
    from swarm_node.spec import RunSpec
    from swarm_node.system import node_threads, run_on_fast_loop

    check_maddrs(args.initial_peers, "--initial-peers", peer_id=True)
    if args.initial_peers_file is not None:
        from_file = _read_maddrs(args.initial_peers_file)
        check_maddrs(from_file, f"--initial-peers-file {args.initial_peers_file}:", peer_id=True)
        args.initial_peers = [*args.initial_peers, *from_file]
    if args.config is None and not args.initial_peers:
        raise ConfigError(
            "give --initial-peers MADDR (the run's bootstrap, as it prints it) or --config RUN_SPEC"
        )
    host_maddrs, announce_maddrs = _listen_addresses(args)
    for flag, folder in (("--run-dir", args.run_dir), ("--checkpoint-dir", args.checkpoint_dir),
                         ("--metrics-dir", args.metrics_dir), ("--data-cache", args.data_cache)):
        check_folder(folder, flag)
    spec = RunSpec.from_file(args.config) if args.config else None
    config = NodeConfig(initial_peers=tuple(args.initial_peers), run_id=args.run_id,
                        host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                        identity_path=str(args.identity) if args.identity else None,
                        lane_port=None if args.no_lanes else args.lane_port,
                        stage=args.stage, device=resolve_device(args.device), max_steps=args.max_steps,
                        run_dir=args.run_dir, data_shard=args.data_shard, round_timeout_s=args.round_timeout,
                        data_cache_gb=args.data_cache_gb, data_private_mirrors=args.data_private_mirrors,
                        **({"data_cache_dir": args.data_cache} if args.data_cache else {}),
                        startup_timeout_s=args.startup_timeout, slowest_link_mbit_s=args.slowest_link_mbit,
                        wait_for_peers_per_stage=args.wait_for_peers,
                        download_state=not args.no_state_download, state_from=args.state_from,
                        checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every_rounds=args.checkpoint_every_rounds,
                        blocking_rounds=args.blocking_rounds,
                        one_payload_at_a_time=args.one_payload_at_a_time,
                        max_update_ratio=args.max_update_ratio, http_host=args.http_host,
                        metrics_sinks=tuple(m for m in args.metrics if m != "none"),
                        metrics_dir=args.metrics_dir,
                        threads=args.threads or node_threads(), compute_share=args.compute_share,
                        compile_stage=args.compile,
                        command_line=("swarm-node", *args.argv),
                        http_port=args.http_port, progress=not args.no_progress)
    node = Node(spec, config)
    if args.on_node is not None:
        args.on_node(node)
    run_on_fast_loop(node.run())
    return 0
