"""``swarm-node sim``: an in-process swarm in one process."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.cli.args import (
    ACTIVATION_CODEC_NAMES,
    BOUNDARY_CODEC_NAMES,
    DATA_HELP,
    MODEL_HELP,
    OUTER_CODEC_NAMES,
    OUTER_LANDING_NAMES,
    THREADS_DEFAULT_HELP,
    int_list,
    positive_int,
)


def add_sim_parser(sub) -> None:
    p = sub.add_parser("sim", help="train an in-process swarm (R replicas x S stages) in one process",
                       description="Simulate a swarm in one process: random routing between stages, "
                                   "the real inner and outer optimizers, fresh random pairs every round.")
    p.add_argument("--method", choices=("noloco", "diloco", "ddp", "local"), default="noloco",
                   help="how the replicas of a stage keep in step: noloco (random groups, default), diloco "
                        "(all replicas of the stage), ddp (gradients averaged every step: the reference) or local "
                        "(no exchange: the baseline)")
    p.add_argument("--replicas", type=positive_int, default=4, help="workers per stage (R); default: %(default)s")
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (S); default: %(default)s")
    p.add_argument("--model", default="debug", help=MODEL_HELP)
    p.add_argument("--layers-per-stage", type=int_list, default=None, metavar="N,N,...",
                   help="explicit split of the layers, e.g. 5,7 (default: even, earlier stages take the remainder)")
    p.add_argument("--data", default="corpus", help=DATA_HELP)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence; default: %(default)s")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per worker per step; default: %(default)s")
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="inner optimizer steps per worker; default: %(default)s")
    p.add_argument("--inner-steps", type=positive_int, default=None, metavar="H",
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
    p.add_argument("--activation-codec", choices=ACTIVATION_CODEC_NAMES + BOUNDARY_CODEC_NAMES, default="fp32",
                   help="how activations and their gradients cross stage boundaries, as a node sends them (int8: "
                        "blockwise codes with a scale per 256 values; bottleneck, subspace: a coded boundary of "
                        "a few values a token, docs/ALGORITHM.md 9); default: %(default)s")
    p.add_argument("--activation-ratio", type=float, default=None, metavar="R",
                   help="with a coded boundary: send at most 1/R of fp16's bytes each way, token ids and "
                        "frames counted (32: the issue's target)")
    p.add_argument("--outer-codec", choices=OUTER_CODEC_NAMES, default="fp32",
                   help="how phi and Delta go on the wire in outer rounds: a float precision, or blockwise "
                        "codes with error feedback (nearP-D: phi in P bits coded against the receiver's own, "
                        "Delta in D); default: %(default)s")
    p.add_argument("--outer-latency-steps", type=positive_int, default=None, metavar="K",
                   help="overlapped outer rounds: the exchange lands K inner steps after the boundary while "
                        "training goes on (docs/ALGORITHM.md 3.1); default: blocking rounds")
    p.add_argument("--outer-landing", choices=OUTER_LANDING_NAMES, default="whole",
                   help="overlapped rounds: phi and Delta land together, or Delta is sent ahead of phi and moves "
                        "the inner steps as soon as it is in (an exchange longer than a round: the wait "
                        "comes first, until the Delta is in; docs/ALGORITHM.md 3.1); default: %(default)s")
    p.add_argument("--eval-every", type=positive_int, default=None, metavar="STEPS",
                   help="steps between evaluations (default: --steps / 20)")
    p.add_argument("--eval-batches", type=positive_int, default=8, metavar="N",
                   help="validation batches of 64 windows per evaluation; default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order; default: %(default)s")
    p.add_argument("--device", default="cpu",
                   help="cpu | cuda[:N] | mps | auto (CUDA, else Apple MPS, else CPU); default: %(default)s")
    p.add_argument("--threads", type=positive_int, default=None, help=f"torch CPU threads; {THREADS_DEFAULT_HELP}")
    p.add_argument("--json-out", type=Path, default=None, metavar="PATH", help="write the JSON summary here")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the loss curves")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_sim)


def run_sim(args: argparse.Namespace) -> int:
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
    if (args.activation_ratio is None) == (args.activation_codec in BOUNDARY_CODEC_NAMES):
        from swarm_node.errors import ConfigError

        raise ConfigError("--activation-ratio goes with a coded boundary (--activation-codec "
                          f"{' | '.join(BOUNDARY_CODEC_NAMES)}), and only with one")
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
                       activation_codec=args.activation_codec, activation_ratio=args.activation_ratio,
                       outer_codec=args.outer_codec,
                       outer_latency_steps=args.outer_latency_steps, outer_landing=args.outer_landing,
                       eval_every_steps=args.eval_every or max(1, args.steps // 20),
                       eval_batches=args.eval_batches, device=resolve_device(args.device))
    run_simulation(config, json_out=args.json_out, plot=args.plot, progress=not args.no_progress)
    return 0
