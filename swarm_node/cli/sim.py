"""``swarm-node sim``: an in-process swarm in one process."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.cli import options
from swarm_node.cli.args import BOUNDARY_CODEC_NAMES, OUTER_LANDING_NAMES, positive_int


def add_sim_parser(sub) -> None:
    p = sub.add_parser("sim", help="train an in-process swarm (R replicas x S stages) in one process",
                       description="Simulate a swarm in one process: random routing between stages, "
                                   "the real inner and outer optimizers, fresh random pairs every round.")
    options.method(p, methods=options.SIM_METHODS)
    options.replicas(p, default=4, who="workers")
    options.stages(p)
    options.model(p)
    options.data(p)
    options.tokenizer(p, use="sim")
    options.seq_len(p)
    options.batch_size(p)
    options.steps(p, default=1000, whose="of every worker")
    options.inner_steps(p)
    options.lr(p)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="learning-rate warm-up (default: 4%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay; default: %(default)s")
    p.add_argument("--alpha", type=float, default=None,
                   help="outer momentum (default: 0.3; the NoLoCo paper ran 0.5: docs/ALGORITHM.md 3.4)")
    p.add_argument("--beta", type=float, default=None, help="outer learning rate (default: 0.7)")
    p.add_argument("--gamma", type=float, default=None,
                   help="NoLoCo pull towards the group mean (default: 0.7)")
    p.add_argument("--nesterov", action="store_true", help="Nesterov outer momentum instead of heavy-ball")
    p.add_argument("--group-size", type=int, default=2,
                   help="NoLoCo group size; default: %(default)s (pairs)")
    p.add_argument("--routing", choices=("random", "fixed"), default="random",
                   help="random: a fresh random path through the stages per micro-batch (default); fixed: "
                        "replica r always uses worker r of every stage")
    options.codecs(p, default="fp32", boundaries=True)
    p.add_argument("--outer-latency-steps", type=positive_int, default=None, metavar="K",
                   help="overlapped outer rounds: the exchange lands K inner steps after the boundary while "
                        "training goes on (docs/ALGORITHM.md 3.1); default: blocking rounds")
    p.add_argument(
        "--outer-landing",
        choices=OUTER_LANDING_NAMES,
        default="whole",
        help="overlapped rounds: phi and Delta land together, or Delta is sent ahead of phi and moves "
        "the inner steps as soon as it is in (an exchange longer than a round: the wait "
        "comes first, until the Delta is in; docs/ALGORITHM.md 3.1); default: %(default)s",
    )
    p.add_argument("--eval-every", type=positive_int, default=None, metavar="STEPS",
                   help="steps between evaluations (default: --steps / 20)")
    options.eval_batches(p)
    options.seed(p)
    options.device(p, default="cpu")
    options.threads(p, node=False)
    options.json_out(p)
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the loss curves")
    options.no_progress(p)
    p.set_defaults(handler=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    import torch

    from swarm_node.config import default_warmup_steps, resolve_device, suggested_lr
    from swarm_node.data.spec import DataSpec
    from swarm_node.data.tokenizer import HFTokenizer
    from swarm_node.optim import InnerHyper, default_method
    from swarm_node.sim.config import SimConfig
    from swarm_node.sim.run import run_simulation
    from swarm_node.spec import CLI_NAMES, check_model_split
    from swarm_node.system import default_threads

    check_model_split(args.model, args.stages, args.layers_per_stage, CLI_NAMES)
    if args.tokenizer:
        HFTokenizer(args.tokenizer, "--tokenizer")  # refused before the data is read
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
