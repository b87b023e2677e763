"""A byte-level BPE tokenizer trained on the text a dataset is prepared from
(`swarm-node data prepare --train-tokenizer VOCAB`), written beside the shards as
tokenizer.json and listed in the manifest like one the host gives.

Byte-level: the 256 byte values are tokens, so every text encodes and no token is
unknown; END_OF_TEXT ends every document of the shards (data/tokenizer.py). Training is
deterministic for the same documents in the same order and the same options, whatever
the number of threads (the trainer orders merges by count, then by the pair): the same
source prepared twice gives the same tokenizer file, so the same manifest.

Beside it, TRAINED_FILE records what it was trained on: the source, the options, a
digest of the source's file names, sizes and modification times, and the tokenizer's
SHA-256. A rerun of prepare with the same source and options reuses the tokenizer (an
interrupted preparation resumes without training again); an edited source or other
options train anew."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from swarm_node.errors import ConfigError
from swarm_node.system import write_atomic

log = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT,)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB = 2**32  # what the shard format's 32-bit token ids hold (data/shard_format.py)
TOKENIZER_FILE = "tokenizer.json"
TRAINED_FILE = "tokenizer.trained.json"


def check_vocab(vocab_size: int, setting: str = "--train-tokenizer") -> None:
    if type(vocab_size) is not int or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"{setting} {vocab_size}: a trained vocabulary holds {MIN_VOCAB} to {MAX_VOCAB:,} "
                          f"tokens (the 256 bytes and {END_OF_TEXT}, up to what 32-bit token ids hold); "
                          "8192 to 50257 is usual")


def train_bpe(documents: Iterable[str], vocab_size: int, *, count: int | None = None,
              progress: bool = False) -> bytes:
    """The tokenizer.json of a byte-level BPE of at most ``vocab_size`` tokens trained on
    ``documents`` (``count`` of them, for the progress bars); fewer where the text holds
    no more merges."""
    check_vocab(vocab_size)
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError("training a tokenizer needs the 'tokenizers' package: "
                          "pip install 'swarm-node[hf-tokenizer]'") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    with _stdout_on_stderr(progress):
        tokenizer.train_from_iterator(documents, trainer, length=count)
    return tokenizer.to_str().encode()


@contextlib.contextmanager
def _stdout_on_stderr(active: bool) -> Iterator[None]:
    """The trainer ends each progress bar (drawn on stderr) with a newline on stdout, the
    stream a host pipes the printed [data] table from: it goes to stderr too."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def trained_tokenizer(out: Path, vocab_size: int, *, source: str, source_path: Path | None, options: dict,
                      documents: Callable[[], tuple[int, Iterator[str | None]]], progress: bool) -> Path:
    """``out``/tokenizer.json: trained on ``documents()`` (their count, and the texts; None
    for a record without text), or the one an earlier run trained on the same
    ``source`` (its files under ``source_path``, where it has some) and ``options``."""
    check_vocab(vocab_size)
    settings = {"source": source, "vocab_size": vocab_size, "special_tokens": list(SPECIAL_TOKENS),
                "options": options, "files": _listing(source_path)}
    target, record = out / TOKENIZER_FILE, out / TRAINED_FILE
    if target.is_file() and record.is_file():
        try:
            kept = json.loads(record.read_text())
        except ValueError:
            kept = None
        if (isinstance(kept, dict) and kept.get("settings") == settings
                and kept.get("sha256") == hashlib.sha256(target.read_bytes()).hexdigest()):
            log.info("tokenizer: %s was trained on the same source and options: not training again", target)
            return target
    count, texts = documents()
    log.info("tokenizer: training a byte-level BPE of %d tokens on %s (%s)", vocab_size, source,
             "its text files" if count is None else f"{count} documents")
    started = time.monotonic()
    data = train_bpe((t for t in texts if t is not None), vocab_size, count=count, progress=progress)
    write_atomic(target, data, durable=True)
    kept = {"settings": settings, "sha256": hashlib.sha256(data).hexdigest()}
    write_atomic(record, json.dumps(kept).encode(), durable=True)
    trained = len(json.loads(data)["model"]["vocab"])
    log.info("tokenizer: trained %d tokens in %.1f s: %s", trained, time.monotonic() - started, target)
    if trained < vocab_size:
        log.warning("tokenizer: the text holds merges for %d tokens, fewer than the %d asked: the manifest's "
                    "vocabulary is %d (more text, or a smaller --train-tokenizer, sizes it as asked)",
                    trained, vocab_size, trained)
    return target


def _listing(path: Path | None) -> str:
    """A digest of the names, sizes and modification times of the files at ``path``:
    what tells an edited source without reading it."""
    if path is None or not path.exists():
        return ""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        name = file.name if file == path else file.relative_to(path).as_posix()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
