"""``swarm-node local``: a whole swarm of node processes on this machine."""

from __future__ import annotations

import argparse

from swarm_node.cli import options
from swarm_node.cli.args import check_folder, positive_int


def add_local_parser(sub) -> None:
    p = sub.add_parser("local", help="run a whole swarm of node processes on this machine",
                       description="Start a bootstrap DHT and S x R node processes on loopback, train, "
                                   "evaluate, and shut everything down.")
    options.stages(p)
    options.replicas(p, default=2, who="nodes")
    options.model(p)
    options.data(p)
    options.seq_len(p)
    options.batch_size(p)
    options.steps(p, default=200, whose="of each stage-0 node (later stages step as their gradients arrive)")
    options.method(p, methods=options.SWARM_METHODS)
    options.inner_steps(p)
    options.lr(p)
    options.seed(p)
    options.codecs(p, default=None, boundaries=True)
    options.blocking_rounds(p, every_node=True)
    options.no_lanes(p, every_node=True)
    p.add_argument(
        "--registry-shards",
        type=positive_int,
        default=None,
        metavar="S",
        help="DHT keys each stage's registry is spread over, a power of two (default: the largest at or "
        "below replicas / 4; from 8 replicas up the nodes then read one shard at a time and "
        "heartbeat every 6 s, which keeps 32 nodes' DHT traffic within what 2 cores can serve)",
    )
    options.device(p, default="cpu", every_node=True)
    options.compile_stage(p, every_node=True)
    options.round_timeout(p, default=15.0, every_node=True)
    p.add_argument("--threads-per-node", type=positive_int, default=1, metavar="T",
                   help="torch CPU threads of each node; default: %(default)s")
    options.compute_share(p, every_node=True)
    options.eval_batches(p)
    options.run_dir(p, swarm=True)
    options.checkpoint_dir(p, swarm=True)
    options.json_out(p)
    p.add_argument("--chaos-kills", type=int, default=0, metavar="N",
                   help="fault injection: SIGKILL N random nodes at random moments of the run")
    p.add_argument("--chaos-restarts", type=int, default=0, metavar="M",
                   help="start M of the killed nodes again from their checkpoints")
    p.add_argument("--chaos-seed", type=int, default=0, metavar="SEED",
                   help="which nodes are killed and when; default: %(default)s")
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also run a swarm-bootstrap serving the live dashboard on this port (0: any free port)",
    )
    options.no_progress(p)
    p.set_defaults(handler=run_local)


def run_local(args: argparse.Namespace) -> int:
    import logging
    import secrets

    from swarm_node.cli.spec_flags import spec_tables
    from swarm_node.local.swarm import ChaosPlan, LocalConfig, local_exit_status, run_local
    from swarm_node.membership.registry import suggested_shards
    from swarm_node.spec import CLI_NAMES, RunSpec, check_model_split

    for flag, folder in (("--run-dir", args.run_dir), ("--checkpoint-dir", args.checkpoint_dir),
                         ("--json-out", args.json_out and args.json_out.parent)):
        check_folder(folder, flag)
    # First, with the flags' names; RunSpec checks the same again with its keys' names.
    check_model_split(args.model, args.stages, args.layers_per_stage, CLI_NAMES)
    tables = spec_tables(args, "local")  # the flags as a spec file's tables, read as a spec file is
    tables.setdefault("registry_shards", suggested_shards(args.replicas))
    spec = RunSpec.from_dict({"run_id": f"local-{secrets.token_hex(4)}", **tables}, "(from the flags)")
    method = spec.method
    if method.has_outer_step and method.inner_steps > args.steps:
        logging.getLogger("swarm_node.local").warning(
            "--steps %d is shorter than one outer round (H = %d inner steps): the nodes will not exchange "
            "weights; lower --inner-steps or raise --steps",
            args.steps,
            method.inner_steps,
        )
    config = LocalConfig(replicas=args.replicas, steps=args.steps, device=args.device,
                         compile_stage=args.compile, round_timeout_s=args.round_timeout, run_dir=args.run_dir,
                         progress=not args.no_progress, threads_per_node=args.threads_per_node,
                         compute_share=args.compute_share, eval_batches=args.eval_batches,
                         blocking_rounds=args.blocking_rounds, lanes=not args.no_lanes,
                         dashboard_port=args.dashboard_port, checkpoint_dir=args.checkpoint_dir,
                         chaos=ChaosPlan(kills=args.chaos_kills,
                                         restarts=min(args.chaos_restarts, args.chaos_kills),
                                         seed=args.chaos_seed) if args.chaos_kills else None)
    return local_exit_status(run_local(spec, config, args.json_out))
