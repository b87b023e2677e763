"""Command line of `swarm-node data prepare` (parsing only; the work is in
swarm_node.data.prepare)."""

from __future__ import annotations

from swarm_node.cli import options
from swarm_node.cli.args import check_folder


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="prepare a dataset that a run's volunteers fetch from peers",
                          description="Work with the prepared datasets a run trains on: `swarm-node data "
                                      "prepare --help` says how to make one.")
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = actions.add_parser(
        "prepare",
        help="tokenize a source into verified shards and a manifest",
        description="Tokenize text files, a local Hugging Face dataset or a token file with the run's "
                    "tokenizer "
        "(given, or trained on the text first with --train-tokenizer) into fixed-size token "
        "shards, and write a manifest of their sizes and SHA-256 hashes. Put the printed [data] "
        "table in the run spec, and start the bootstrap with --data OUT: volunteers then fetch "
        "the manifest, the tokenizer and the shards they train from peers, checking every chunk. "
        "Interrupted, it resumes where it stopped when run again with the same options.",
    )
    p.add_argument("source", help="text:PATH (a file or a folder of .txt/.md/.rst in UTF-8; a file holding "
                                  "NUL bytes, or over 1%% of characters that are not UTF-8, is refused as "
                                  "binary) | hf:PATH (a saved Hugging Face dataset or .json/.jsonl/.parquet "
                                  "files) | bin:PATH (token ids) | corpus")
    options.out(p, holds="the shards and the manifest", replaced=False)
    options.tokenizer(p, use="prepare")
    p.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="VOCAB",
        help="first train a byte-level BPE of VOCAB tokens (the 256 bytes and <|endoftext|> among "
        "them; 257 to 2^32, 8192 to 50257 usual) on the source, and write it as "
        "OUT/tokenizer.json: the same source and options train the same tokenizer, and a rerun "
        "reuses it. Default: no training. Either way, each document ends with the tokenizer's "
        "end-of-text token (<|endoftext|>, <|end_of_text|> or </s>) where it has one, else "
        "with a blank line",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=8 << 20,
        help="tokens per shard (default %(default)s: 16 MB of 16-bit ids); a volunteer fetches whole "
        "shards, so smaller shards start training sooner",
    )
    p.add_argument("--chunk-kb", type=int, default=1024,
                   help="size of the verified pieces a shard is fetched in (default %(default)s KiB)")
    p.add_argument("--val-fraction", type=float, default=0.02,
                   help="share of the shards held out for validation (at least one; default %(default)s)")
    p.add_argument("--text-field", default="text",
                   help="hf: the column holding the text (default %(default)s)")
    p.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="URL",
        help="an http(s) folder that will hold the same files: volunteers try it after peers (repeatable)",
    )
    options.no_progress(p)
    p.set_defaults(handler=_run_prepare)

def _run_prepare(args) -> int:
    from swarm_node.data.prepare import PrepareConfig, prepare

    check_folder(args.out, "--out")
    config = PrepareConfig(source=args.source, out_dir=args.out, tokenizer_path=args.tokenizer,
                           train_vocab=args.train_tokenizer,
                           shard_tokens=args.shard_tokens, chunk_bytes=args.chunk_kb * 1024,
                           val_fraction=args.val_fraction, text_field=args.text_field,
                           sources=tuple(args.mirror),
                           progress=not args.no_progress)
    created = not args.out.exists()
    try:
        manifest, digest = prepare(config)
    except BaseException:
        if created and args.out.is_dir() and not any(args.out.iterdir()):
            args.out.rmdir()  # a failed first attempt leaves no empty --out behind
        raise
    size = sum(e.bytes for e in manifest.train + manifest.val)
    print(f"prepared {len(manifest.train)} training and {len(manifest.val)} validation shards in {args.out}: "
          f"{manifest.train_tokens() / 1e6:.1f} M training tokens, vocabulary {manifest.vocab_size}, "
          f"{size / 1e6:.1f} MB")
    print("put this in the run spec:\n"
          "  [data]\n"
          '  kind = "manifest"\n'
          f'  manifest_sha256 = "{digest}"\n'
          f"and serve it with: swarm-bootstrap --run-spec RUN.toml --data {args.out}")
    return 0
