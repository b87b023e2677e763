"""Command lines of `swarm-node export` and `swarm-node generate` (parsing only; the
work is in swarm_node.export)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swarm_node.cli import options
from swarm_node.cli.args import check_folder
from swarm_node.export.replicas import SPREAD_RULE

EXPORT_DESCRIPTION = (
    "Assemble one model from the checkpoints of every stage (several peers of a stage are averaged) and "
    "write config.json, model.safetensors and, when the run used a Hugging Face tokenizer, its files. Load "
    "it with transformers' LlamaForCausalLM.from_pretrained(OUT); a bottleneck run's model (its stage "
    "boundaries are layers of their own) also gets its modelling file: "
    "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True). Peers of a stage are averaged only "
    "when they are at about the same point of training; checkpoints of a stage that are far apart are "
    "refused unless --force is given. Far apart: "
    f"{SPREAD_RULE}. Checkpoints of different run specs, or two of one stage from the same peer, are always "
    "refused.")


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", description=EXPORT_DESCRIPTION,
                       help="write a Hugging Face Llama checkpoint assembled from stage checkpoints")
    _checkpoint_args(p)
    options.out(p, holds="the model's files", replaced=True)
    p.set_defaults(handler=_run_export)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from stage checkpoints",
                       description="Assemble one model from the checkpoints of every stage, as export does "
                                   "(same checks), and sample text.")
    _checkpoint_args(p)
    p.add_argument("--prompt", required=True, help="text the sample continues (printed before it)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0: greedy, always the likeliest token (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens (0: all; default: %(default)s)")
    options.seed(p, sampling=True)
    p.set_defaults(handler=_run_generate)


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, nargs="+", required=True, metavar="DIR",
                   help="nodes' --checkpoint-dir (newest intact checkpoint) or ckpt-* directories, covering "
                        "every stage of the run")
    options.tokenizer(p, use="export")
    options.data_cache(p, reads=True)
    p.add_argument("--force", action="store_true",
                   help="average the checkpoints of a stage even when they are far apart in training, with a "
                        "warning per stage instead of a refusal. Far apart: " + SPREAD_RULE.replace("%",
                                                                                                    "%%"))


def _tokenizer_path(args: argparse.Namespace, assembled) -> Path | None:
    if args.tokenizer is not None:
        return args.tokenizer
    data = assembled.spec.data
    if data.kind == "manifest":
        from swarm_node.data.source import prepared_tokenizer
        from swarm_node.node_config import default_data_cache_dir
        return prepared_tokenizer(data, args.data_cache or default_data_cache_dir())
    return Path(data.tokenizer_path) if data.tokenizer_path else None


def _run_export(args: argparse.Namespace) -> int:
    from swarm_node.data.tokenizer import HFTokenizer
    from swarm_node.export.assemble import assemble
    from swarm_node.export.hf import write_hf_checkpoint

    check_folder(args.out, "--out")
    if args.tokenizer is not None:
        HFTokenizer(args.tokenizer, "--tokenizer")  # refused before the checkpoints are read
    assembled = assemble(args.checkpoint, force=args.force)
    written = write_hf_checkpoint(assembled, args.out, _tokenizer_path(args, assembled))
    params = sum(t.numel() for t in assembled.state_dict.values())
    boundary = assembled.config.boundary
    what = ("a Hugging Face Llama checkpoint" if boundary is None else
            f"a Hugging Face Llama with its {boundary.kind} boundaries (load with trust_remote_code=True)")
    print(f"wrote {what} of run {assembled.spec.run_id!r} ({params:,} parameters; peers "
          f"averaged per stage: {assembled.peers_per_stage}) to {args.out}:", file=sys.stderr)
    for path in written:
        print(f"  {path.name}", file=sys.stderr)
    if _tokenizer_path(args, assembled) is None:
        print("  (byte-level tokenizer: token id = UTF-8 byte value; no tokenizer files)", file=sys.stderr)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from swarm_node.data.tokenizer import AlphabetTokenizer, load_tokenizer
    from swarm_node.export.assemble import assemble, load_model
    from swarm_node.export.generate import sample

    assembled = assemble(args.checkpoint, force=args.force)
    if assembled.spec.data.kind == "synthetic":  # symbols shown as letters
        tokenizer = AlphabetTokenizer(assembled.config.vocab_size)
    else:
        tokenizer = load_tokenizer(_tokenizer_path(args, assembled),
                                   "--tokenizer" if args.tokenizer else "the run's tokenizer")
    model = load_model(assembled)
    ids = sample(model, tokenizer.encode(args.prompt), max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(args.prompt + tokenizer.decode(ids))
    return 0
