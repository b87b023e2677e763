"""Subword text for the size trend: the bundled corpus, tokenized with a BPE tokenizer
the benchmark trains once and keeps (bench/results/size_trend.tokenizer.json, so every
later run reads the same tokens), prepared into shards with `swarm-node data prepare`
in a cache folder (rebuilt when missing)."""

from __future__ import annotations

from pathlib import Path

from bench.common import ROOT
from bench.common.results import RESULTS_DIR

VOCAB = 4096
TOKENIZER = RESULTS_DIR / "size_trend.tokenizer.json"
DATA_DIR = ROOT / "runs" / "bench-data" / "size_trend"
SHARD_TOKENS = 1 << 16


def train_tokenizer(path: Path = TOKENIZER, vocab: int = VOCAB) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the bundled corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from swarm_node.data.dataset import _read_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_read_corpus().split("\n\n\n"), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def subword_data(tokenizer: Path = TOKENIZER, out_dir: Path = DATA_DIR) -> str:
    """The data spec (``manifest:FOLDER``) of the corpus in subword tokens, prepared on
    first use; the tokenizer is trained first if it is not kept yet."""
    from swarm_node.data.manifest import MANIFEST_FILE, Manifest, sha256_hex
    from swarm_node.data.prepare import PrepareConfig, prepare

    if not tokenizer.is_file():
        train_tokenizer(tokenizer)
    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = Manifest.from_bytes(manifest_path.read_bytes())
        if manifest.tokenizer is not None and manifest.tokenizer.sha256 == sha256_hex(tokenizer.read_bytes()):
            return f"manifest:{out_dir}"
    prepare(PrepareConfig(source="corpus", out_dir=out_dir, tokenizer_path=tokenizer, shard_tokens=SHARD_TOKENS,
                          val_fraction=0.05, progress=False))
    return f"manifest:{out_dir}"
