"""The options that more than one command has (sim, local, join, export, generate, data
prepare, swarm-bootstrap's --data), each declared here once: its name, type and one help
text that states its default. Where commands really differ (sim also simulates ddp; a
node's device default is auto, a swarm's on one machine cpu; ...) the difference is a
parameter the command's file passes, so it is seen where the command is built. An
option only one command has is declared in that command's file; the network options of
join and swarm-bootstrap are in peer_options.py; the run-spec keys the training options
set are in spec_flags.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_node.cli.args import (
    ACTIVATION_CODEC_NAMES,
    BOUNDARY_CODEC_NAMES,
    DATA_HELP,
    MODEL_HELP,
    OUTER_CODEC_NAMES,
    THREADS_DEFAULT_HELP,
    int_list,
    positive_float,
    positive_int,
    unit_share,
)

Parser = argparse.ArgumentParser


def _whose(every_node: bool) -> str:
    """`local` sets a node's option for every node it starts, and says so."""
    return "every node: " if every_node else ""


# -- what a run trains and how (their run-spec keys: spec_flags.py) -------------------------------

# spec.py's SWARM_METHODS and optim/methods.py's METHODS (a test keeps them equal): the
# parser runs before torch is imported
SWARM_METHODS = ("noloco", "diloco", "local")
SIM_METHODS = ("noloco", "diloco", "ddp", "local")
METHOD_HELP = {"noloco": "random groups of a stage, pairs by default", "diloco": "all replicas of the stage",
               "ddp": "gradients averaged every step: the reference", "local": "no exchange: the baseline"}


def method(p: Parser, *, methods: tuple[str, ...]) -> None:
    """``methods``: what the command runs (ddp only in the simulator: a swarm of
    strangers does not average gradients every step)."""
    listed = [f"{name} ({METHOD_HELP[name]})" for name in methods]
    p.add_argument("--method", choices=methods, default="noloco",
                   help=f"how the replicas of a stage keep in step: {', '.join(listed[:-1])} or "
                        f"{listed[-1]}; default: %(default)s")


def inner_steps(p: Parser) -> None:
    p.add_argument("--inner-steps", type=positive_int, default=None, metavar="H",
                   help="inner steps between outer rounds (default: 50 noloco, 100 diloco)")


def lr(p: Parser) -> None:
    p.add_argument("--lr", type=positive_float, default=None,
                   help="peak inner learning rate (default: by --model, from 3e-3 for debug to 1.2e-4 "
                        "for large)")


def seed(p: Parser, *, sampling: bool = False) -> None:
    """``sampling``: the seed of generate's sampling, not of a run's weights and data."""
    what = "seed of the sampling" if sampling else "initial weights and data order"
    p.add_argument("--seed", type=int, default=0, help=f"{what}; default: %(default)s")


def stages(p: Parser) -> None:
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (S); default: %(default)s")


def replicas(p: Parser, *, default: int, who: str) -> None:
    """``who``: what a replica is (the simulator's workers, local's node processes)."""
    p.add_argument("--replicas", type=positive_int, default=default,
                   help=f"{who} per stage (R); default: %(default)s")


def model(p: Parser) -> None:
    p.add_argument("--model", default="debug", help=MODEL_HELP)
    p.add_argument("--layers-per-stage", type=int_list, default=None, metavar="N,N,...",
                   help="explicit split of the layers, e.g. 5,7 or 0,1,1 (default: even, earlier stages take "
                        "the remainder; first and last stages may hold none)")


def seq_len(p: Parser) -> None:
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="tokens per sequence; default: %(default)s")


def batch_size(p: Parser) -> None:
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per micro-batch and per inner step; default: %(default)s")


def steps(p: Parser, *, default: int, whose: str) -> None:
    """``whose``: who counts them (every simulated worker; local's stage-0 nodes, which
    the later stages follow as gradients arrive)."""
    p.add_argument("--steps", type=positive_int, default=default,
                   help=f"inner steps {whose}; default: %(default)s")


def codecs(p: Parser, *, default: str | None, boundaries: bool = False) -> None:
    """What goes on the wire: the simulator's ``default`` is "fp32", the exact values
    the codes are measured against; a swarm's is None, the run spec's (near4-3 and fp16,
    which suit volunteers' links). ``boundaries``: the coded boundaries too (where the
    command can run them), with their ratio."""
    def shown(spec_default: str) -> str:
        if default is None:
            return f"the run spec's, {spec_default}"
        return (f"%(default)s, the exact values the codes are measured against (a swarm's default is "
                f"the run spec's, {spec_default})")

    p.add_argument("--outer-codec", choices=OUTER_CODEC_NAMES, default=default,
                   help="how phi and Delta go on the wire in outer rounds: a float precision, or blockwise "
                        "codes with error feedback (nearP-D: phi in P bits coded against the receiver's own, "
                        f"Delta in D); default: {shown('near4-3')}")
    coded = ("; bottleneck, subspace: a coded boundary of a few values a token, docs/ALGORITHM.md 9"
             if boundaries else "")
    p.add_argument(
        "--activation-codec",
        choices=ACTIVATION_CODEC_NAMES + (BOUNDARY_CODEC_NAMES if boundaries else ()),
        default=default,
        help="how activations and their gradients cross stage boundaries, as a node sends them "
        f"(int8: blockwise codes with a scale per 256 values, half the bytes of fp16{coded}); "
        f"default: {shown('fp16')}",
    )
    if boundaries:
        p.add_argument("--activation-ratio", type=float, default=None, metavar="R",
                       help="with a coded boundary: send at most 1/R of fp16's bytes each way, token ids and "
                            "frames counted (32: the issue's target); default: none")


def eval_batches(p: Parser) -> None:
    p.add_argument("--eval-batches", type=positive_int, default=8, metavar="N",
                   help="validation batches of 64 windows per evaluation (the bundled corpus has 8); "
                        "default: %(default)s")


# -- data -----------------------------------------------------------------------------------------

def data(p: Parser, *, served: bool = False) -> None:
    """The data a run trains on: a source a training command reads, or (``served``) the
    folder `swarm-node data prepare` wrote, which swarm-bootstrap serves to volunteers."""
    if served:
        p.add_argument("--data", type=Path, default=None, metavar="DIR",
                       help="the prepared dataset the run spec names (`swarm-node data prepare --out DIR`), "
                            "served to volunteers; default: none served")
    else:
        p.add_argument("--data", default="corpus", help=DATA_HELP)


def tokenizer(p: Parser, *, use: str) -> None:
    """``use``: "sim", the tokenizer.json a simulation encodes with; "prepare", the one a
    prepared dataset is encoded with, a file or a cached model's; "export", the run's,
    written beside an exported model or decoding a sample."""
    if use == "prepare":
        p.add_argument("--tokenizer", default=None, metavar="FILE_OR_NAME",
                       help="the run's tokenizer: a Hugging Face tokenizer.json, or a model's name (gpt2, "
                            "ORG/NAME, NAME@REVISION) whose tokenizer.json is in this machine's Hugging Face "
                            "cache ($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub; nothing is "
                            "downloaded). Default: none, so UTF-8 bytes (vocabulary 256) unless "
                            "--train-tokenizer")
    elif use == "export":
        p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                       help="the run's tokenizer.json (default: the spec's tokenizer_path, relative to here; "
                            "for a prepared dataset, the one in the data cache)")
    else:
        p.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="Hugging Face tokenizer.json (default: bytes)")


def data_cache(p: Parser, *, reads: bool = False) -> None:
    """``reads``: export reads the run's tokenizer where the node fetched the dataset."""
    where = ("where the node fetched the run's prepared dataset (its --data-cache), for the run's tokenizer"
             if reads else "where a run's prepared dataset is fetched to")
    p.add_argument("--data-cache", type=Path, default=None, metavar="DIR",
                   help=f"{where}; default: ~/.cache/swarm-node/data")


# -- the machine ----------------------------------------------------------------------------------

def device(p: Parser, *, default: str, every_node: bool = False) -> None:
    """``default``: auto for a node, which uses the card its machine has; cpu for a whole
    swarm or simulation on one machine, which asks for a card by name."""
    p.add_argument("--device", default=default,
                   help=f"{_whose(every_node)}cpu | cuda[:N] | mps | auto (CUDA, else Apple MPS, else CPU); "
                        "default: %(default)s")


def compile_stage(p: Parser, *, every_node: bool = False) -> None:
    p.add_argument("--compile", action="store_true",
                   help=f"{_whose(every_node)}run the stage through torch.compile, compiled at start-up "
                        "(seconds to minutes, logged): faster steps on a GPU, the same math")


def threads(p: Parser, *, node: bool) -> None:
    """``node``: a node's training thread, which leaves a core to its networking."""
    default = ("OMP_NUM_THREADS if set, else the cores not already busy less one for the node's "
               "networking, at least 1" if node else THREADS_DEFAULT_HELP.removeprefix("default: "))
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads{' of the training thread' if node else ''}; default: {default}")


def compute_share(p: Parser, *, every_node: bool = False) -> None:
    p.add_argument("--compute-share", type=unit_share, default=1.0, metavar="F",
                   help=f"{_whose(every_node)}compute at most this share of the time, 0 < F <= 1: after each "
                        "piece of work the node rests in proportion, so a machine you also use stays "
                        "responsive; it trains at about F of its speed and its peers send it less; "
                        "default: %(default)s")


# -- a node's outer rounds and links --------------------------------------------------------------

def round_timeout(p: Parser, *, default: float, every_node: bool = False) -> None:
    p.add_argument("--round-timeout", type=float, default=default, metavar="SECONDS",
                   help=f"{_whose(every_node)}seconds to seek a partner per outer round before the "
                        "local-only step; default: %(default)s")


def blocking_rounds(p: Parser, *, every_node: bool = False) -> None:
    p.add_argument("--blocking-rounds", action="store_true",
                   help=f"{_whose(every_node)}stop the inner steps during each outer round until its outer "
                        "step is done, instead of exchanging beside them (for comparison; costs the whole "
                        "exchange time every round)")


def no_lanes(p: Parser, *, every_node: bool = False) -> None:
    p.add_argument("--no-lanes", action="store_true",
                   help=f"{_whose(every_node)}send everything over libp2p, no direct lanes (for comparison)")


# -- files and output -----------------------------------------------------------------------------

def run_dir(p: Parser, *, swarm: bool) -> None:
    """``swarm``: local keeps every node's files, in a temporary folder unless given; a
    node writes its own only when given one."""
    what = ("keep every node's log, final weights and summary here (default: a temporary directory, "
            "removed)" if swarm else "write the summary and final weights here (default: none are written)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="DIR", help=what)


def checkpoint_dir(p: Parser, *, swarm: bool) -> None:
    """``swarm``: local's nodes each write to a folder of their own under it."""
    where = ("every node writes them to DIR/stageS-rR; `swarm-node export --checkpoint DIR/stage0-r0 "
             "DIR/stage1-r0 ... --out MODEL` turns them into a model, as the run's last lines say" if swarm
             else "the node resumes from the newest one there (same --identity to keep the peer id)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help=f"write a checkpoint after every outer round and at the end: {where}")


def json_out(p: Parser) -> None:
    p.add_argument("--json-out", type=Path, default=None, metavar="PATH", help="write the JSON summary here")


def out(p: Parser, *, holds: str, replaced: bool) -> None:
    """``replaced``: the files already there are replaced (export), not resumed from."""
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help=f"folder for {holds} (created if missing"
                        f"{'; files already there are replaced' if replaced else ''})")


def no_progress(p: Parser, *, instead: str | None = None) -> None:
    """``instead``: what a long-running node logs in its place."""
    p.add_argument("--no-progress", action="store_true",
                   help=f"no progress bar{f': {instead}' if instead else ''}")
