"""The data spec: which tokens a run trains on. It is part of the run spec that all
peers share, so it holds only things every peer can reproduce (no local paths for the
built-in sources)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

KINDS = ("synthetic", "corpus", "text", "bin", "hf", "manifest")
WITH_PATH = ("text", "bin", "hf")
HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DataSpec:
    kind: str = "corpus"
    path: str | None = None  # text file/folder, .bin file, or Hugging Face dataset (kinds text, bin, hf)
    text_field: str = "text"  # kind hf: the column holding the text
    tokenizer_path: str | None = None  # Hugging Face tokenizer.json; byte-level when None
    # kind manifest: the SHA-256 of a prepared dataset's manifest (`swarm-node data
    # prepare`). Volunteers fetch it, the tokenizer and their shards from peers and check
    # every byte against it; path, if given, is a folder already holding the dataset.
    manifest_sha256: str | None = None
    # kind manifest: stage-0 nodes claim one of this many slots, each a disjoint part of
    # every pass over the shards (data/slot_batches.py); 0: one per training shard. About the
    # number of stage-0 peers expected: fewer slots than peers share slots.
    slots: int = 0
    val_fraction: float = 0.02
    min_val_windows: int = 16
    # synthetic Markov source
    alphabet: int = 16
    order: int = 2
    concentration: float = 0.5
    data_seed: int = 0
    num_tokens: int = 4_000_000

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown data kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind in WITH_PATH and not self.path:
            raise ValueError(f"data kind {self.kind!r} needs a path")
        if self.kind == "manifest" and not (isinstance(self.manifest_sha256, str)
                                            and HEX64.fullmatch(self.manifest_sha256)):
            raise ValueError("data kind 'manifest' needs manifest_sha256: the 64 hex digits "
                             "`swarm-node data prepare` printed")
        if type(self.slots) is not int or not 0 <= self.slots <= 1 << 20:
            raise ValueError(f"data slots must be an integer from 0 to {1 << 20}, got {self.slots!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

    @classmethod
    def parse(cls, text: str) -> DataSpec:
        """``synthetic[:alphabet=16,order=2,...]``, ``corpus``, ``text:PATH``, ``bin:PATH``,
        ``hf:PATH`` (a Hugging Face dataset saved to disk, or .json/.jsonl/.parquet files;
        column ``text``), ``manifest:SHA256`` (a prepared dataset fetched from peers),
        ``manifest:FOLDER`` (one prepared here), or a bare path (``*.bin`` is read as
        tokens, anything else as text)."""
        kind, _, rest = text.partition(":")
        if kind == "synthetic":
            return cls(kind="synthetic", **_parse_options(rest, cls))
        if kind == "corpus" and not rest:
            return cls(kind="corpus")
        if kind in WITH_PATH and rest:
            return cls(kind=kind, path=rest)
        if kind == "manifest" and rest:
            if HEX64.fullmatch(rest):
                return cls(kind="manifest", manifest_sha256=rest)
            from swarm_node.data.manifest import local_manifest_sha256
            return cls(kind="manifest", manifest_sha256=local_manifest_sha256(Path(rest)), path=rest)
        path = Path(text)
        if not path.exists():
            raise ValueError(
                f"--data {text!r}: not 'synthetic', 'corpus', 'text:PATH', 'bin:PATH', 'hf:PATH', "
                "'manifest:SHA256|FOLDER' "
                "or an existing path"
            )
        return cls(kind="bin" if path.suffix == ".bin" else "text", path=text)

    def describe(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic order-{self.order} Markov over {self.alphabet} symbols (seed {self.data_seed})"
        if self.kind == "corpus":
            return "bundled corpus (CPython 3.11 stdlib docstrings)"
        if self.kind == "manifest":
            return f"prepared dataset {self.manifest_sha256[:16]}…"
        return f"{self.kind}:{self.path}"


def _parse_options(text: str, cls) -> dict:
    if not text:
        return {}
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    casts = {"int": int, "float": float}
    options = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = {"seed": "data_seed", "tokens": "num_tokens"}.get(key.strip(), key.strip())
        if not sep or key not in ("alphabet", "order", "concentration", "data_seed", "num_tokens"):
            raise ValueError(f"bad synthetic option {item!r}; use alphabet=, order=, concentration=, "
                             "seed=, tokens=")
        options[key] = casts[types[key]](value)
    return options
