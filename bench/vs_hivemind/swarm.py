"""``swarm-node local --stages 1 --replicas N`` for bench.vs_hivemind, with checkpoints on.

    python -m bench.vs_hivemind.swarm --replicas N --steps S --run-dir D --json-out F [...]

The same swarm as the command line builds (same run spec, same node processes), with
one difference: every node writes a checkpoint after each outer round, so the benchmark
can evaluate the weights along the way on the validation windows (the summary's own
validation curve has only the start and the end). Checkpoints are switched on the way
the chaos test does, with a fault plan that kills nobody."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swarm_node.config import default_warmup_steps, suggested_lr
from swarm_node.data.spec import DataSpec
from swarm_node.local.swarm import ChaosPlan, LocalConfig, run_local
from swarm_node.obs.logs import setup_logging
from swarm_node.optim import InnerHyper, default_method
from swarm_node.spec import RunSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default="debug")
    parser.add_argument("--data", default="corpus")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--inner-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--json-out", type=Path, required=True)
    args = parser.parse_args(argv)
    setup_logging()
    spec = RunSpec(run_id="sbe-vs-hivemind", model_size=args.model, num_stages=1, seq_len=args.seq_len,
                   batch_size=args.batch_size, samples_per_step=args.batch_size, total_steps=args.steps,
                   seed=args.seed, data=DataSpec.parse(args.data),
                   method=default_method("noloco", inner_steps=args.inner_steps),
                   inner=InnerHyper(lr=args.lr or suggested_lr(args.model),
                                    warmup_steps=default_warmup_steps(args.steps), total_steps=args.steps))
    config = LocalConfig(replicas=args.replicas, steps=args.steps, run_dir=args.run_dir, progress=False,
                         chaos=ChaosPlan(kills=0))
    summary = run_local(spec, config, args.json_out)
    return 0 if summary["final_val_loss"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
