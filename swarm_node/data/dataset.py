"""Token windows: load a source into one flat token array, cut it into windows of
seq_len + 1 tokens (inputs and shifted targets), and hold the last windows out for
validation."""

from __future__ import annotations

import gzip
import json
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from swarm_node.data.markov import MarkovChain, MarkovSpec
from swarm_node.data.spec import DataSpec
from swarm_node.data.tokenizer import AlphabetTokenizer, Tokenizer, load_tokenizer
from swarm_node.errors import ConfigError, DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
HF_FILE_SUFFIXES = {".json", ".jsonl", ".parquet"}
CORPUS_FILE = "stdlib_docstrings.txt.gz"


@dataclass
class TokenWindows:
    tokens: np.ndarray  # flat token ids; may be a read-only memmap
    vocab_size: int
    seq_len: int
    num_val_windows: int
    tokenizer: Tokenizer
    entropy_floor: float | None = None  # best achievable loss (synthetic data only)

    @property
    def window_len(self) -> int:
        return self.seq_len + 1

    @property
    def num_windows(self) -> int:
        return len(self.tokens) // self.window_len

    @property
    def num_train_windows(self) -> int:
        return self.num_windows - self.num_val_windows

    def batch(self, window_indices: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both (B, seq_len) int64."""
        idx = np.asarray(window_indices, dtype=np.int64)
        offsets = idx[:, None] * self.window_len + np.arange(self.window_len)[None, :]
        windows = torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))
        return windows[:, :-1], windows[:, 1:]

    def val_batches(self, batch_size: int, max_batches: int | None = None):
        first = self.num_train_windows
        starts = range(first, self.num_windows, batch_size)
        for n, start in enumerate(starts):
            if max_batches is not None and n >= max_batches:
                return
            yield self.batch(np.arange(start, min(start + batch_size, self.num_windows)))


def load_windows(spec: DataSpec, seq_len: int, *, min_train_windows: int = 0) -> TokenWindows:
    """Load the data of ``spec`` cut for ``seq_len``. For synthetic data, at least
    ``min_train_windows`` training windows are generated so a run never repeats data."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if spec.kind == "synthetic":
        return _synthetic(spec, seq_len, min_train_windows)
    if spec.kind == "manifest":
        if spec.path is None:
            raise DataError("this run's data is a prepared dataset that nodes fetch from peers; to read it "
                            "here, give the folder holding it (data path, or --data manifest:FOLDER)")
        return _prepared(Path(spec.path), spec.manifest_sha256, seq_len)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    if spec.kind == "bin":
        tokens, vocab_size = _read_bin(Path(spec.path))
    else:
        if spec.kind == "hf":
            text = _read_hf_dataset(Path(spec.path), spec.text_field)
        else:
            text = _read_corpus() if spec.kind == "corpus" else _read_text(Path(spec.path))
        ids = tokenizer.encode(text)
        tokens = np.asarray(ids, dtype=np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
        vocab_size = tokenizer.vocab_size
    windows = len(tokens) // (seq_len + 1)
    num_val = max(spec.min_val_windows, math.ceil(spec.val_fraction * windows))
    if windows - num_val < 1:
        raise ValueError(f"{spec.describe()} has {len(tokens)} tokens: too few for seq_len {seq_len}")
    return TokenWindows(tokens=tokens, vocab_size=vocab_size, seq_len=seq_len, num_val_windows=num_val,
                        tokenizer=tokenizer)


def _prepared(folder: Path, manifest_sha256: str, seq_len: int) -> TokenWindows:
    """A prepared dataset held whole in ``folder``: its training shards, then its
    validation shards, as one token array (every file checked against the manifest)."""
    from swarm_node.data.manifest import MANIFEST_FILE, Manifest
    from swarm_node.data.shard_format import open_shard

    manifest = Manifest.from_bytes((folder / MANIFEST_FILE).read_bytes(), expect_sha256=manifest_sha256)
    parts = {}
    for entry in manifest.train + manifest.val:
        path = folder / entry.name
        if not entry.held_in(path):  # the host's own folder: refused, never deleted as a cache would
            raise DataError(f"{path} is missing or differs from the manifest; prepare or fetch it again")
        parts[entry.name] = open_shard(path, vocab_size=manifest.vocab_size)
    window_len = seq_len + 1
    val_windows = sum(len(parts[e.name]) for e in manifest.val) // window_len
    tokens = np.concatenate([parts[e.name] for e in manifest.train + manifest.val])
    if val_windows < 1 or len(tokens) // window_len - val_windows < 1:
        raise DataError(f"the prepared dataset in {folder} has too few tokens for seq_len {seq_len}")
    tokenizer = (
        load_tokenizer(folder / manifest.tokenizer.name) if manifest.tokenizer else load_tokenizer(None)
    )
    return TokenWindows(tokens=tokens, vocab_size=manifest.vocab_size, seq_len=seq_len,
                        num_val_windows=val_windows, tokenizer=tokenizer)


def _synthetic(spec: DataSpec, seq_len: int, min_train_windows: int) -> TokenWindows:
    chain = MarkovChain(MarkovSpec(spec.alphabet, spec.order, spec.concentration, spec.data_seed))
    window_len = seq_len + 1
    num_val = max(spec.min_val_windows, math.ceil(spec.val_fraction * spec.num_tokens / window_len))
    num_train = max(spec.num_tokens // window_len - num_val, min_train_windows, 1)
    train = chain.sample_windows(num_train, window_len, seed=1)
    val = chain.sample_windows(num_val, window_len, seed=2)  # separate stream: never seen in training
    tokens = np.concatenate([train.ravel(), val.ravel()])
    return TokenWindows(tokens=tokens, vocab_size=spec.alphabet, seq_len=seq_len, num_val_windows=num_val,
                        tokenizer=AlphabetTokenizer(spec.alphabet), entropy_floor=chain.loss_floor(seq_len))


def _read_corpus() -> str:
    blob = resources.files("swarm_node.data").joinpath("corpus", CORPUS_FILE).read_bytes()
    return gzip.decompress(blob).decode("utf-8")


def corpus_documents() -> list[str]:
    """The bundled corpus as documents: one module's docstrings each."""
    return _read_corpus().split("\n\n\n")


def _read_text(path: Path) -> str:
    return "\n\n".join(read_text_file(f) for f in _text_files(path))


MAX_UNDECODED_SHARE = 0.01


def read_text_file(path: Path) -> str:
    """A text source's file as UTF-8 (:func:`decode_text`)."""
    return decode_text(path.read_bytes(), path)


def decode_text(raw: bytes, path: Path) -> str:
    """Bytes of a text source's file as UTF-8. Bytes holding a NUL, or that do not decode
    as UTF-8 for more than 1 % of their characters, are binary (or another encoding) and
    refused: they would become tokens of replacement characters. A few stray bytes are
    replaced."""
    text = raw.decode("utf-8", errors="replace")
    undecoded = text.count("\ufffd") - raw.count("\ufffd".encode())
    if b"\0" in raw or undecoded > MAX_UNDECODED_SHARE * len(text):
        what = ("holds NUL bytes" if b"\0" in raw
                else f"has {undecoded} of {len(text)} characters that are not UTF-8")
        raise ConfigError(f"{path} {what}: it is binary data or not UTF-8 text; remove it from the text "
                          "source or convert it to UTF-8")
    return text


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise FileNotFoundError(f"text data not found: {path}")
    if not files:
        raise FileNotFoundError(f"no {'/'.join(sorted(TEXT_SUFFIXES))} files under {path}")
    return files


def _read_hf_dataset(path: Path, text_field: str) -> str:
    _, docs = _read_hf_documents(path, text_field)
    return "\n\n".join(t for t in docs if t is not None)


def _read_hf_documents(path: Path, text_field: str):
    """(count, iterator of texts, None for a row without one) of a local Hugging Face
    dataset: a ``save_to_disk`` folder (its ``train`` split when it is a DatasetDict), or
    .json/.jsonl/.parquet files (one file or a folder of them). In order; nothing is
    downloaded."""
    try:
        import datasets
    except ImportError:
        raise ImportError("Hugging Face datasets need the 'datasets' package: "
                          "pip install 'swarm-node[hf-datasets]'") from None
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{path}: a dataset with splits {sorted(loaded)} but no 'train' split")
            loaded = loaded["train"]
    else:
        files = (
            [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in HF_FILE_SUFFIXES)
        )
        if not files:
            raise FileNotFoundError(
                f"no saved dataset or {'/'.join(sorted(HF_FILE_SUFFIXES))} files under {path}"
            )
        suffixes = {f.suffix for f in files}
        if len(suffixes) > 1:
            raise ValueError(f"{path}: mixed file types {sorted(suffixes)}; use one format")
        builder = "parquet" if suffixes == {".parquet"} else "json"
        loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    if text_field not in loaded.column_names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(loaded.column_names)}); "
                         "set data.text_field in the run spec")
    return len(loaded), (t if isinstance(t, str) else None for t in loaded[text_field])


def _read_bin(path: Path) -> tuple[np.ndarray, int]:
    """A flat array of token ids (nanoGPT layout). A sidecar ``<file>.json`` may give
    ``dtype`` (default uint16) and ``vocab_size`` (default: max id + 1, found by a scan)."""
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    meta_path = path.with_name(path.name + ".json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    dtype = np.dtype(meta.get("dtype", "uint16"))
    if dtype.kind != "u":
        raise ValueError(f"{path}: token dtype must be unsigned, got {dtype}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    vocab_size = meta.get("vocab_size")
    if vocab_size is None:
        log.info("%s has no %s; scanning for the largest token id", path.name, meta_path.name)
        chunk = 1 << 24
        vocab_size = 1 + max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))
    return tokens, int(vocab_size)
