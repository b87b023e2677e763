"""One hivemind.Optimizer training peer (or the run's bootstrap DHT) for bench.vs_hivemind.

    python -m bench.vs_hivemind.peer bootstrap --maddr-file F
    python -m bench.vs_hivemind.peer train --rank R --peers N --maddr-file F --out-dir D [...]

A peer trains the project's Llama-style model (built by swarm_node.model as one full
stage, the same seed and name-keyed init as a swarm-node node) on its shard of the same
data with the same inner AdamW, clipping and per-step lr schedule, and lets
hivemind.Optimizer keep the peers together. Every ``--inner-steps`` steps it writes a
snapshot of its weights with the wall time, so the benchmark can evaluate them all on
the same validation windows afterwards (evaluating here would cost training time).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

from swarm_node.config import default_warmup_steps
from swarm_node.data.dataset import load_windows
from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.data.spec import DataSpec
from swarm_node.model.config import model_config
from swarm_node.model.stages import build_model
from swarm_node.optim.inner import InnerHyper, lr_at

RUN_ID = "sbe-vs-hivemind"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("bootstrap", "train"))
    parser.add_argument("--maddr-file", type=Path, required=True,
                        help="the bootstrap writes its multiaddrs here")
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--mode", choices=("local-updates", "grad-averaging"), default="local-updates")
    parser.add_argument("--model", default="debug")
    parser.add_argument("--data", default="corpus")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--inner-steps", type=int, default=50, help="local steps per peer between averagings")
    parser.add_argument("--lr", type=float, required=False, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matchmaking-s", type=float, default=3.0)
    parser.add_argument("--averaging-timeout-s", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: the project's for --steps")
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="where the DHT listens (default: hivemind's, loopback only); e.g. /ip4/0.0.0.0/tcp/0 "
        "on a host others must reach",
    )
    return parser.parse_args(argv)


def dht_kwargs(args: argparse.Namespace) -> dict:
    return {"host_maddrs": args.host_maddrs} if args.host_maddrs else {}


def run_bootstrap(maddr_file: Path, **dht_options) -> None:
    """A DHT peer that trains nothing, like the one ``swarm-node local`` runs in-process."""
    import hivemind

    dht = hivemind.DHT(start=True, **dht_options)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tmp = maddr_file.with_suffix(".tmp")
    tmp.write_text("\n".join(str(m) for m in dht.get_visible_maddrs()))
    tmp.replace(maddr_file)  # readers never see half a file
    stop.wait()
    dht.shutdown()


def wait_for_maddrs(maddr_file: Path, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not maddr_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bootstrap did not write {maddr_file}")
        time.sleep(0.1)  # polling a file the bootstrap writes once
    return maddr_file.read_text().split()


def epoch_schedule(args: argparse.Namespace, hyper: InnerHyper):
    """grad-averaging takes one optimizer step per epoch; hivemind steps the scheduler
    per epoch, so the same warm-up and cosine run over epochs instead of steps."""
    epochs = max(1, args.steps // args.inner_steps)
    per_epoch = InnerHyper(lr=hyper.lr, warmup_steps=default_warmup_steps(epochs), total_steps=epochs)
    return partial(torch.optim.lr_scheduler.LambdaLR,
                   lr_lambda=lambda epoch: lr_at(epoch, per_epoch) / hyper.lr)


def make_optimizer(args: argparse.Namespace, dht, model: torch.nn.Module, hyper: InnerHyper):
    """hivemind.Optimizer as its docs configure it for a small local run, with the
    project's inner AdamW. One epoch is ``inner_steps`` local batches of every peer, so
    parameters are averaged as often as NoLoCo's rounds come (local-updates; the lr
    follows the per-step schedule, set in the training loop), or gradients are
    all-reduced over that global batch for one optimizer step (grad-averaging). Both
    average in fp16, like the project's wire."""
    import hivemind
    from hivemind.compression import Float16Compression

    local = args.mode == "local-updates"
    return hivemind.Optimizer(
        dht=dht, run_id=RUN_ID, batch_size_per_step=args.batch_size,
        target_batch_size=args.peers * args.batch_size * args.inner_steps,
        optimizer=partial(torch.optim.AdamW, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                          weight_decay=hyper.weight_decay),
        params=model.parameters(), scheduler=None if local else epoch_schedule(args, hyper),
        use_local_updates=local, matchmaking_time=args.matchmaking_s,
        averaging_timeout=args.averaging_timeout_s,
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        verbose=True)


def save_snapshot(out_dir: Path, rank: int, step: int, model: torch.nn.Module, epoch: int) -> None:
    path = out_dir / f"snap-r{rank}-{step:07d}.pt"
    torch.save({"step": step, "epoch": epoch, "time": time.time(),
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def train(args: argparse.Namespace) -> None:
    import hivemind

    torch.set_num_threads(args.threads)
    data = load_windows(DataSpec.parse(args.data), args.seq_len)
    config = model_config(args.model, vocab_size=data.vocab_size, max_seq_len=args.seq_len)
    model = build_model(config, seed=args.seed)
    loader = ShardedBatches(data, batch_size=args.batch_size, seed=args.seed, shard_id=args.rank,
                            num_shards=args.peers)
    warmup = default_warmup_steps(args.steps) if args.warmup_steps is None else args.warmup_steps
    hyper = InnerHyper(lr=args.lr, warmup_steps=warmup, total_steps=args.steps)
    dht = hivemind.DHT(initial_peers=wait_for_maddrs(args.maddr_file), start=True, **dht_kwargs(args))
    opt = make_optimizer(args, dht, model, hyper)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_snapshot(args.out_dir, args.rank, 0, model, opt.local_epoch)  # its time marks the start of training
    # A peer stopped at a benchmark's time limit keeps what it trained by then: on a slow
    # link hivemind's epochs shrink to one step each, an averaging round apiece, and the
    # snapshot every H steps came once in three minutes (its "final" weights were the
    # ones of the first minute, reached long before it was stopped). The snapshot is
    # taken in the handler: the stop reaches hivemind's own processes too, and the step
    # under way may never return.
    stop = threading.Event()
    done = [0]  # steps taken

    def on_stop(*_) -> None:
        if not stop.is_set():
            stop.set()
            if done[0] % args.inner_steps:  # not saved yet (an earlier time would be overwritten)
                save_snapshot(args.out_dir, args.rank, done[0], model, opt.local_epoch)

    signal.signal(signal.SIGTERM, on_stop)
    for step in range(args.steps):
        if stop.is_set():
            break
        inputs, targets = loader.next_batch()
        loss = model(inputs, targets)
        loss.backward()
        if hyper.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.clip_norm)
        if args.mode == "local-updates":  # the same per-step schedule as a swarm-node node
            for group in opt.opt.param_groups:
                group["lr"] = lr_at(step, hyper)
        opt.step()
        opt.zero_grad()
        done[0] = step + 1
        if (step + 1) % args.inner_steps == 0 or step + 1 == args.steps:
            save_snapshot(args.out_dir, args.rank, step + 1, model, opt.local_epoch)
    opt.shutdown()
    dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "bootstrap":
        run_bootstrap(args.maddr_file, **dht_kwargs(args))
        return 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
