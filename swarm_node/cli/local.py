"""``swarm-node local``: a whole swarm of node processes on this machine."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.cli.args import (
    ACTIVATION_CODEC_NAMES,
    DATA_HELP,
    MODEL_HELP,
    OUTER_CODEC_NAMES,
    check_folder,
    int_list,
    positive_float,
    positive_int,
    unit_share,
)


def add_local_parser(sub) -> None:
    p = sub.add_parser("local", help="run a whole swarm of node processes on this machine",
                       description="Start a bootstrap DHT and S x R node processes on loopback, train, "
                                   "evaluate, and shut everything down.")
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (S); default: %(default)s")
    p.add_argument("--replicas", type=positive_int, default=2, help="nodes per stage (R); default: %(default)s")
    p.add_argument("--model", default="debug", help=MODEL_HELP)
    p.add_argument("--layers-per-stage", type=int_list, default=None, metavar="N,N,...",
                   help="explicit split of the layers, e.g. 0,1,1 (default: even, earlier stages take the "
                        "remainder; first and last stages may hold none)")
    p.add_argument("--data", default="corpus", help=DATA_HELP)
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence; default: %(default)s")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per micro-batch and per inner step; default: %(default)s")
    p.add_argument("--steps", type=positive_int, default=200,
                   help="inner steps of each stage-0 node; default: %(default)s")
    p.add_argument("--method", choices=("noloco", "diloco", "local"), default="noloco",
                   help="noloco (random pairs, default), diloco (all nodes of the stage) or local (no weight "
                        "exchange: the baseline)")
    p.add_argument("--inner-steps", type=positive_int, default=None, metavar="H",
                   help="inner steps between outer rounds (default: 50 noloco, 100 diloco)")
    p.add_argument("--lr", type=positive_float, default=None,
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
    p.add_argument("--registry-shards", type=positive_int, default=None, metavar="S",
                   help="DHT keys each stage's registry is spread over, a power of two (default: the largest at or "
                        "below replicas / 4; from 8 replicas up the nodes then read one shard at a time and "
                        "heartbeat every 6 s, which keeps 32 nodes' DHT traffic within what 2 cores can serve)")
    p.add_argument("--device", default="cpu",
                   help="device of every node: cpu | cuda[:N] | mps | auto; default: %(default)s")
    p.add_argument("--compile", action="store_true",
                   help="every node runs its stage through torch.compile (swarm-node join --compile)")
    p.add_argument("--round-timeout", type=float, default=15.0, metavar="SECONDS",
                   help="seconds a node seeks a partner per outer round; default: %(default)s")
    p.add_argument("--threads-per-node", type=positive_int, default=1,
                   help="torch CPU threads of each node; default: %(default)s")
    p.add_argument("--compute-share", type=unit_share, default=1.0, metavar="F",
                   help="each node computes at most this share of the time, 0 < F <= 1, and rests the remainder "
                        "(leaves the machine to other work; the swarm trains at about F of its speed); "
                        "default: %(default)s")
    p.add_argument("--eval-batches", type=positive_int, default=8, metavar="N",
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
    p.set_defaults(handler=run_local)


def run_local(args: argparse.Namespace) -> int:
    import logging
    import secrets

    from swarm_node.config import default_warmup_steps, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.local.swarm import ChaosPlan, LocalConfig, local_exit_status, run_local
    from swarm_node.membership.registry import suggested_shards
    from swarm_node.optim import InnerHyper, default_method
    from swarm_node.spec import CLI_NAMES, RunSpec, check_model_split

    for flag, folder in (("--run-dir", args.run_dir), ("--checkpoint-dir", args.checkpoint_dir),
                         ("--json-out", args.json_out and args.json_out.parent)):
        check_folder(folder, flag)
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
