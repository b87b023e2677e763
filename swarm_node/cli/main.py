"""The ``swarm-node`` command line. It only parses arguments and hands them on."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swarm_node import __version__
from swarm_node.cli.data import add_data_parser
from swarm_node.cli.export import add_export_parser, add_generate_parser
from swarm_node.cli.probe import add_probe_parser
from swarm_node.errors import ConfigError, SwarmError
from swarm_node.node.config import DEFAULT_STARTUP_TIMEOUT_S, check_compute_share
from swarm_node.obs.sinks import SINKS

# wire/outer_codec.py's table and wire/messages.py's (a test keeps them equal): the parser
# runs before torch is imported
OUTER_CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "near4-4", "near4-3")
ACTIVATION_CODEC_NAMES = ("fp32", "fp16", "bf16", "int8")
OUTER_LANDING_NAMES = ("whole", "delta-first")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


MODEL_HELP = "debug (2 layers) | mini (4) | tiny (4) | small (12) | medium (24) | large (32); default: %(default)s"
DATA_HELP = ("synthetic[:alphabet=16,order=2,...] | corpus (the bundled docstrings) | text:PATH | bin:PATH | hf:PATH "
             "| manifest:FOLDER (prepared by `swarm-node data prepare`) | PATH; default: %(default)s")
THREADS_DEFAULT_HELP = ("default: the cores not already busy (measured over half a second at the start), at least "
                        "1: more threads than free cores leave torch's threads spinning, waiting for each other")


def _add_sim_parser(sub) -> None:
    p = sub.add_parser("sim", help="train an in-process swarm (R replicas x S stages) in one process",
                       description="Simulate a swarm in one process: random routing between stages, "
                                   "the real inner and outer optimizers, fresh random pairs every round.")
    p.add_argument("--method", choices=("noloco", "diloco", "ddp", "local"), default="noloco",
                   help="how the replicas of a stage keep in step: noloco (random groups, default), diloco "
                        "(all replicas of the stage), ddp (gradients averaged every step: the reference) or local "
                        "(no exchange: the baseline)")
    p.add_argument("--replicas", type=_positive_int, default=4, help="workers per stage (R); default: %(default)s")
    p.add_argument("--stages", type=_positive_int, default=2, help="pipeline stages (S); default: %(default)s")
    p.add_argument("--model", default="debug", help=MODEL_HELP)
    p.add_argument("--layers-per-stage", type=_int_list, default=None, metavar="N,N,...",
                   help="explicit split of the layers, e.g. 5,7 (default: even, earlier stages take the remainder)")
    p.add_argument("--data", default="corpus", help=DATA_HELP)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence; default: %(default)s")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="sequences per worker per step; default: %(default)s")
    p.add_argument("--steps", type=_positive_int, default=1000,
                   help="inner optimizer steps per worker; default: %(default)s")
    p.add_argument("--inner-steps", type=_positive_int, default=None, metavar="H",
                   help="inner steps between outer rounds (default: 50 noloco, 100 diloco)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak inner learning rate (default: by --model, from 3e-3 for debug to 1.2e-4 for large)")
    p.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up (default: 4%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay; default: %(default)s")
    p.add_argument("--alpha", type=float, default=None,
                   help="outer momentum (default: 0.3; the NoLoCo paper ran 0.5: docs/ALGORITHM.md 3.4)")
    p.add_argument("--beta", type=float, default=None, help="outer learning rate (default: 0.7)")
    p.add_argument("--gamma", type=float, default=None,
                   help="NoLoCo pull towards the group mean (default: 0.7)")
    p.add_argument("--nesterov", action="store_true", help="Nesterov outer momentum instead of heavy-ball")
    p.add_argument("--group-size", type=int, default=2, help="NoLoCo group size; default: %(default)s (pairs)")
    p.add_argument("--routing", choices=("random", "fixed"), default="random",
                   help="random: a fresh random path through the stages per micro-batch (default); fixed: "
                        "replica r always uses worker r of every stage")
    p.add_argument("--activation-codec", choices=ACTIVATION_CODEC_NAMES, default="fp32",
                   help="how activations and their gradients cross stage boundaries, as a node sends them (int8: "
                        "blockwise codes with a scale per 256 values); default: %(default)s")
    p.add_argument("--outer-codec", choices=OUTER_CODEC_NAMES, default="fp32",
                   help="how phi and Delta go on the wire in outer rounds: a float precision, or blockwise "
                        "codes with error feedback (nearP-D: phi in P bits coded against the receiver's own, "
                        "Delta in D); default: %(default)s")
    p.add_argument("--outer-latency-steps", type=_positive_int, default=None, metavar="K",
                   help="overlapped outer rounds: the exchange lands K inner steps after the boundary while "
                        "training goes on (docs/ALGORITHM.md 3.1); default: blocking rounds")
    p.add_argument("--outer-landing", choices=OUTER_LANDING_NAMES, default="whole",
                   help="overlapped rounds: phi and Delta land together, or Delta is sent ahead of phi and moves "
                        "the inner steps as soon as it is in (an exchange longer than a round: the wait "
                        "comes first, until the Delta is in; docs/ALGORITHM.md 3.1); default: %(default)s")
    p.add_argument("--eval-every", type=_positive_int, default=None, metavar="STEPS",
                   help="steps between evaluations (default: --steps / 20)")
    p.add_argument("--eval-batches", type=_positive_int, default=8, metavar="N",
                   help="validation batches of 64 windows per evaluation; default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order; default: %(default)s")
    p.add_argument("--device", default="cpu",
                   help="cpu | cuda[:N] | mps | auto (CUDA, else Apple MPS, else CPU); default: %(default)s")
    p.add_argument("--threads", type=_positive_int, default=None, help=f"torch CPU threads; {THREADS_DEFAULT_HELP}")
    p.add_argument("--json-out", type=Path, default=None, metavar="PATH", help="write the JSON summary here")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the loss curves")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    import torch

    from swarm_node.config import default_warmup_steps, resolve_device, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.optim import InnerHyper, default_method
    from swarm_node.sim.config import SimConfig
    from swarm_node.sim.run import run_simulation
    from swarm_node.spec import CLI_NAMES, check_model_split
    from swarm_node.system import default_threads

    check_model_split(args.model, args.stages, args.layers_per_stage, CLI_NAMES)
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    if args.threads is None:
        logging.getLogger("swarm_node.sim").info("using %d torch thread%s (--threads to change)", threads,
                                                 "s" if threads > 1 else "")
    data = DataSpec.parse(args.data)
    if args.tokenizer:
        data = dataclasses.replace(data, tokenizer_path=args.tokenizer)
    method = default_method(args.method, inner_steps=args.inner_steps, alpha=args.alpha, beta=args.beta,
                            gamma=args.gamma, nesterov=args.nesterov, group_size=args.group_size)
    inner = InnerHyper(lr=args.lr or suggested_lr(args.model),
                       warmup_steps=default_warmup_steps(args.steps) if args.warmup_steps is None
                       else args.warmup_steps,
                       total_steps=args.steps, weight_decay=args.weight_decay)
    config = SimConfig(method=method, inner=inner, data=data, replicas=args.replicas, stages=args.stages,
                       model_size=args.model, layers_per_stage=args.layers_per_stage, seq_len=args.seq_len,
                       batch_size=args.batch_size, steps=args.steps, seed=args.seed, routing=args.routing,
                       activation_codec=args.activation_codec, outer_codec=args.outer_codec,
                       outer_latency_steps=args.outer_latency_steps, outer_landing=args.outer_landing,
                       eval_every_steps=args.eval_every or max(1, args.steps // 20),
                       eval_batches=args.eval_batches, device=resolve_device(args.device))
    run_simulation(config, json_out=args.json_out, plot=args.plot, progress=not args.no_progress)
    return 0


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


def _add_join_parser(sub) -> None:
    p = sub.add_parser("join", help="run one swarm node",
                       description="Join a swarm as one node. With --initial-peers alone the node reads the run "
                                   "spec those peers publish, checks it, asks them to dial it back (can others "
                                   "reach it?), picks a stage, downloads state and trains.")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="multiaddrs of peers already in the swarm (the bootstrap's, as it prints them)")
    p.add_argument("--initial-peers-file", type=Path, default=None, metavar="PATH",
                   help="read more initial peers from this file, one multiaddr per line (what "
                        "`swarm-bootstrap --maddrs-file` writes)")
    p.add_argument("--config", type=Path, default=None,
                   help="run spec (.toml or .json); optional with --initial-peers, where it must match the "
                        "published one; required to start a run without a bootstrap")
    p.add_argument("--run-id", default=None, help="which run to join when the initial peers publish several")
    p.add_argument("--stage", type=_stage, default=None,
                   help="auto (default: the stage with the fewest peers; stage 0 for a node others cannot reach) "
                        "or a stage index")
    p.add_argument("--device", default="auto", help="auto (CUDA, else Apple MPS, else CPU) | cpu | cuda[:N] | mps")
    p.add_argument("--compile", action="store_true",
                   help="run the stage through torch.compile, compiled at start-up (seconds to minutes, logged): "
                        "faster steps on a GPU, the same math")
    p.add_argument("--port", type=_port, default=DEFAULT_NODE_PORT,
                   help="TCP port to listen on, on every interface (default %(default)s; 0: any free port). "
                        "Others must be able to reach it: forward it on your router, or the node runs as stage 0 "
                        "only")
    p.add_argument("--lane-port", type=_port, default=0,
                   help="TCP port for direct lanes, which carry activations, outer payloads and state beside libp2p "
                        "at the link's speed (default: any free port; a peer that cannot reach it uses libp2p)")
    p.add_argument("--no-lanes", action="store_true", help="send everything over libp2p (no direct lanes)")
    p.add_argument("--public-ip", default=None, metavar="IP",
                   help="announce this address (with --port) instead of the interfaces' own: your router's public "
                        "IP when you forwarded the port")
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                   help="where to listen, as multiaddrs (instead of --port), e.g. /ip4/127.0.0.1/tcp/0")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="what to tell others to dial (instead of --public-ip), e.g. /dns4/node.example.org/tcp/31338")
    p.add_argument("--identity", default=None,
                   help="private key file, created on first use; keeps the peer id across restarts (default: a "
                        "new identity each start)")
    p.add_argument("--max-steps", type=_positive_int, default=None, help="stop after this many inner steps")
    p.add_argument("--run-dir", type=Path, default=None, help="write the summary and final weights here")
    p.add_argument("--data-shard", type=_shard, default=None, metavar="SHARD/COUNT",
                   help="stage 0: read this shard of the data (default: derived from the peer id)")
    p.add_argument("--data-cache", type=Path, default=None, metavar="DIR",
                   help="where a run's prepared dataset is fetched to (default ~/.cache/swarm-node/data)")
    p.add_argument("--data-cache-gb", type=float, default=None, metavar="GB",
                   help="keep the fetched dataset within this many GB, evicting shards already trained "
                        "(default: no bound; stage 0 needs room for about three shards)")
    p.add_argument("--round-timeout", type=float, default=20.0,
                   help="seconds to seek a partner per outer round before the local-only step (default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   help="seconds for the DHT to start and reach an initial peer; one that accepts "
                        "connections but does not answer (busy) is retried until then (default %(default)s)")
    p.add_argument("--wait-for-peers", type=int, default=0, metavar="N",
                   help="stage 0: before the first micro-batch, wait (up to --startup-timeout) until this "
                        "stage (this node counted) and the next have N training peers: for nodes started "
                        "together (default: start at once)")
    p.add_argument("--slowest-link-mbit", type=_positive_float, default=20.0, metavar="MBIT_S",
                   help="the slowest upload expected among peers; outer exchanges of large stages get deadlines "
                        "that fit it (default %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads of the training thread (default: OMP_NUM_THREADS if set, else the cores "
                        "other processes leave free, less one for this node's networking)")
    p.add_argument("--compute-share", type=_share, default=1.0, metavar="F",
                   help="compute at most this share of the time, 0 < F <= 1: after each piece of work the node rests "
                        "in proportion, so a machine you also use stays responsive; it trains at about F of its "
                        "speed and its peers send it less (default %(default)s)")
    p.add_argument("--no-state-download", action="store_true",
                   help="start from the run's initial weights instead of a live peer's state")
    p.add_argument("--state-from", metavar="PEER_ID", default=None,
                   help="ask this peer first for the stage's state (otherwise donors are picked at random); its "
                        "state is still checked against the stage's other peers before it is used")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="resume from the newest checkpoint here (same --identity to keep the peer id); write one "
                        "after every outer round and on shutdown")
    p.add_argument("--checkpoint-every-rounds", type=_positive_int, default=1, metavar="N",
                   help="write a checkpoint every N outer rounds (default %(default)s)")
    p.add_argument("--blocking-rounds", action="store_true",
                   help="stop the inner steps during each outer round until its outer step is done, instead of "
                        "exchanging beside them (for comparison; costs the whole exchange time every round)")
    p.add_argument("--one-payload-at-a-time", action="store_true",
                   help="when this node sends its outer payload, fetch the partner's only afterwards, instead of "
                        "both at once (for comparison: the order of outer protocol 2.0)")
    p.add_argument("--max-update-ratio", type=_ratio, default=3.0, metavar="X",
                   help="refuse a partner's Delta norm above X times our own recent Delta norms at our round, "
                        "and do not pair with it for 30 minutes (default %(default)s; honest partners of the same "
                        "round measured up to 1.3x); accepted updates count with at most 1.5x")
    p.add_argument("--metrics", nargs="+", choices=(*SINKS, "none"), default=["jsonl"], metavar="SINK",
                   help="where training metrics go: jsonl (default), tensorboard, wandb (offline mode; upload later "
                        "with `wandb sync`), or none")
    p.add_argument("--metrics-dir", type=Path, default=None,
                   help="directory of the metrics (default: --run-dir, else ./runs/RUN_ID)")
    p.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="serve /healthz, /metrics (Prometheus) and /api/status on this port (0: any free port)")
    p.add_argument("--http-host", default="127.0.0.1", help="interface for --http-port (0.0.0.0 in containers)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress line: a plain log line per minute instead (for services and log files)")
    p.set_defaults(handler=_run_join)


def _listen_addresses(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(host maddrs, announce maddrs) from --port/--public-ip or the explicit multiaddrs."""
    if args.host_maddrs:
        host = tuple(args.host_maddrs)
    else:
        host = (f"/ip4/0.0.0.0/tcp/{args.port}",)
    if args.public_ip and args.announce_maddrs:
        raise ConfigError("use either --public-ip or --announce-maddrs, not both")
    if args.public_ip:
        if args.host_maddrs or args.port == 0:
            raise ConfigError("--public-ip needs a fixed --port (and no --host-maddrs): others dial that port")
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


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    try:
        check_compute_share(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}") from None
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"must be above 1, got {text}")
    return value


def _run_join(args: argparse.Namespace) -> int:
    from swarm_node.config import resolve_device
    from swarm_node.node.conductor import Node
    from swarm_node.node.config import NodeConfig
    from swarm_node.spec import RunSpec
    from swarm_node.system import node_threads, run_on_fast_loop

    if args.initial_peers_file is not None:
        args.initial_peers = [*args.initial_peers, *_read_maddrs(args.initial_peers_file)]
    if args.config is None and not args.initial_peers:
        raise ConfigError("give --initial-peers MADDR (the run's bootstrap, as it prints it) or --config RUN_SPEC")
    spec = RunSpec.from_file(args.config) if args.config else None
    host_maddrs, announce_maddrs = _listen_addresses(args)
    config = NodeConfig(initial_peers=tuple(args.initial_peers), run_id=args.run_id,
                        host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, identity_path=args.identity,
                        lane_port=None if args.no_lanes else args.lane_port,
                        stage=args.stage, device=resolve_device(args.device), max_steps=args.max_steps,
                        run_dir=args.run_dir, data_shard=args.data_shard, round_timeout_s=args.round_timeout,
                        data_cache_gb=args.data_cache_gb,
                        **({"data_cache_dir": args.data_cache} if args.data_cache else {}),
                        startup_timeout_s=args.startup_timeout, slowest_link_mbit_s=args.slowest_link_mbit,
                        wait_for_peers_per_stage=args.wait_for_peers,
                        download_state=not args.no_state_download, state_from=args.state_from,
                        checkpoint_dir=args.checkpoint_dir, checkpoint_every_rounds=args.checkpoint_every_rounds,
                        blocking_rounds=args.blocking_rounds, one_payload_at_a_time=args.one_payload_at_a_time,
                        max_update_ratio=args.max_update_ratio, http_host=args.http_host,
                        metrics_sinks=tuple(m for m in args.metrics if m != "none"), metrics_dir=args.metrics_dir,
                        threads=args.threads or node_threads(), compute_share=args.compute_share,
                        compile_stage=args.compile,
                        command_line=("swarm-node", *args.argv),
                        http_port=args.http_port, progress=not args.no_progress)
    node = Node(spec, config)
    if args.on_node is not None:
        args.on_node(node)
    run_on_fast_loop(node.run())
    return 0


def _add_local_parser(sub) -> None:
    p = sub.add_parser("local", help="run a whole swarm of node processes on this machine",
                       description="Start a bootstrap DHT and S x R node processes on loopback, train, "
                                   "evaluate, and shut everything down.")
    p.add_argument("--stages", type=_positive_int, default=2, help="pipeline stages (S); default: %(default)s")
    p.add_argument("--replicas", type=_positive_int, default=2, help="nodes per stage (R); default: %(default)s")
    p.add_argument("--model", default="debug", help=MODEL_HELP)
    p.add_argument("--layers-per-stage", type=_int_list, default=None, metavar="N,N,...",
                   help="explicit split of the layers, e.g. 0,1,1 (default: even, earlier stages take the "
                        "remainder; first and last stages may hold none)")
    p.add_argument("--data", default="corpus", help=DATA_HELP)
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence; default: %(default)s")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="sequences per micro-batch and per inner step; default: %(default)s")
    p.add_argument("--steps", type=_positive_int, default=200,
                   help="inner steps of each stage-0 node; default: %(default)s")
    p.add_argument("--method", choices=("noloco", "diloco", "local"), default="noloco",
                   help="noloco (random pairs, default), diloco (all nodes of the stage) or local (no weight "
                        "exchange: the baseline)")
    p.add_argument("--inner-steps", type=_positive_int, default=None, metavar="H",
                   help="inner steps between outer rounds (default: 50 noloco, 100 diloco)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak inner learning rate (default: by --model, from 3e-3 for debug to 1.2e-4 for large)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order; default: %(default)s")
    p.add_argument("--outer-codec", choices=OUTER_CODEC_NAMES, default=None,
                   help="how phi and Delta go on the wire in outer rounds (default: the run spec's, near4-3: phi in "
                        "4 bits coded against the receiver's own, Delta in 3, with error feedback)")
    p.add_argument("--activation-codec", choices=ACTIVATION_CODEC_NAMES, default=None,
                   help="how activations and their gradients cross stage boundaries (default: the run spec's, fp16; "
                        "int8: blockwise codes, half the bytes)")
    p.add_argument("--blocking-rounds", action="store_true",
                   help="nodes stop their inner steps during outer rounds (for comparison with the overlapped "
                        "default)")
    p.add_argument("--no-lanes", action="store_true",
                   help="nodes send everything over libp2p, no direct lanes (for comparison)")
    p.add_argument("--registry-shards", type=_positive_int, default=None, metavar="S",
                   help="DHT keys each stage's registry is spread over, a power of two (default: the largest at or "
                        "below replicas / 4; from 8 replicas up the nodes then read one shard at a time and "
                        "heartbeat every 6 s, which keeps 32 nodes' DHT traffic within what 2 cores can serve)")
    p.add_argument("--device", default="cpu",
                   help="device of every node: cpu | cuda[:N] | mps | auto; default: %(default)s")
    p.add_argument("--compile", action="store_true",
                   help="every node runs its stage through torch.compile (swarm-node join --compile)")
    p.add_argument("--round-timeout", type=float, default=15.0, metavar="SECONDS",
                   help="seconds a node seeks a partner per outer round; default: %(default)s")
    p.add_argument("--threads-per-node", type=_positive_int, default=1,
                   help="torch CPU threads of each node; default: %(default)s")
    p.add_argument("--compute-share", type=_share, default=1.0, metavar="F",
                   help="each node computes at most this share of the time, 0 < F <= 1, and rests the remainder "
                        "(leaves the machine to other work; the swarm trains at about F of its speed); "
                        "default: %(default)s")
    p.add_argument("--eval-batches", type=_positive_int, default=8, metavar="N",
                   help="validation batches of 64 windows for the final loss (the bundled corpus has 8); "
                        "default: %(default)s")
    p.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                   help="keep logs, weights and summaries here (default: a temporary directory, removed)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="every node writes checkpoints to DIR/stageS-rR (after every outer round and at the end); "
                        "`swarm-node export --checkpoint DIR/stage0-r0 DIR/stage1-r0 ... --out MODEL` turns them "
                        "into a model, as the run's last lines say")
    p.add_argument("--json-out", type=Path, default=None, metavar="PATH", help="write the JSON summary here")
    p.add_argument("--chaos-kills", type=int, default=0, metavar="N",
                   help="fault injection: SIGKILL N random nodes at random moments of the run")
    p.add_argument("--chaos-restarts", type=int, default=0, metavar="M",
                   help="start M of the killed nodes again from their checkpoints")
    p.add_argument("--chaos-seed", type=int, default=0, metavar="SEED",
                   help="which nodes are killed and when; default: %(default)s")
    p.add_argument("--dashboard-port", type=int, default=None, metavar="PORT",
                   help="also run a swarm-bootstrap serving the live dashboard on this port (0: any free port)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run_local)


def _run_local(args: argparse.Namespace) -> int:
    import logging
    import secrets

    from swarm_node.config import default_warmup_steps, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.local.swarm import ChaosPlan, LocalConfig, local_exit_status, run_local
    from swarm_node.membership.registry import suggested_shards
    from swarm_node.optim import InnerHyper, default_method
    from swarm_node.spec import CLI_NAMES, RunSpec, check_model_split

    # First, with the flags' names; RunSpec checks the same again with its keys' names.
    check_model_split(args.model, args.stages, args.layers_per_stage, CLI_NAMES)
    method = default_method(args.method, inner_steps=args.inner_steps)
    if method.has_outer_step and method.inner_steps > args.steps:
        logging.getLogger("swarm_node.local").warning(
            "--steps %d is shorter than one outer round (H = %d inner steps): the nodes will not exchange weights; "
            "lower --inner-steps or raise --steps", args.steps, method.inner_steps)
    spec = RunSpec(run_id=f"local-{secrets.token_hex(4)}", model_size=args.model, num_stages=args.stages,
                   layers_per_stage=args.layers_per_stage, seq_len=args.seq_len, batch_size=args.batch_size,
                   samples_per_step=args.batch_size, total_steps=args.steps, seed=args.seed,
                   data=DataSpec.parse(args.data), method=method,
                   **({"outer_codec": args.outer_codec} if args.outer_codec else {}),
                   **({"activation_codec": args.activation_codec} if args.activation_codec else {}),
                   registry_shards=args.registry_shards or suggested_shards(args.replicas),
                   inner=InnerHyper(lr=args.lr or suggested_lr(args.model),
                                    warmup_steps=default_warmup_steps(args.steps), total_steps=args.steps))
    config = LocalConfig(replicas=args.replicas, steps=args.steps, device=args.device, compile_stage=args.compile,
                         round_timeout_s=args.round_timeout, run_dir=args.run_dir, progress=not args.no_progress,
                         threads_per_node=args.threads_per_node, compute_share=args.compute_share,
                         eval_batches=args.eval_batches,
                         blocking_rounds=args.blocking_rounds, lanes=not args.no_lanes,
                         dashboard_port=args.dashboard_port, checkpoint_dir=args.checkpoint_dir,
                         chaos=ChaosPlan(kills=args.chaos_kills, restarts=min(args.chaos_restarts, args.chaos_kills),
                                         seed=args.chaos_seed) if args.chaos_kills else None)
    return local_exit_status(run_local(spec, config, args.json_out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-node", description="Peer-to-peer swarm training with NoLoCo.")
    parser.add_argument("--version", action="version", version=f"swarm-node {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_sim_parser(sub)
    _add_join_parser(sub)
    _add_local_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_probe_parser(sub)
    add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None, on_node=None) -> int:
    """``on_node``: called with the Node that ``join`` built, before it starts (instruments use it)."""
    from swarm_node.obs.logs import setup_logging

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.on_node = on_node
    setup_logging(args.verbose)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, ImportError, SwarmError) as exc:
        print(f"swarm-node {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarm-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
