"""The data spec: which tokens a run trains on. It is part of the run spec that all
peers share, so it holds only things every peer can reproduce (no local paths for the
built-in sources)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

KINDS = ("synthetic", "corpus", "text", "bin", "hf")
WITH_PATH = ("text", "bin", "hf")


@dataclass(frozen=True)
class DataSpec:
    kind: str = "corpus"
    path: str | None = None  # text file/folder, .bin file, or Hugging Face dataset (kinds text, bin, hf)
    text_field: str = "text"  # kind hf: the column holding the text
    tokenizer_path: str | None = None  # Hugging Face tokenizer.json; byte-level when None
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
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

    @classmethod
    def parse(cls, text: str) -> DataSpec:
        """``synthetic[:alphabet=16,order=2,...]``, ``corpus``, ``text:PATH``, ``bin:PATH``,
        ``hf:PATH`` (a Hugging Face dataset saved to disk, or .json/.jsonl/.parquet files;
        column ``text``), or a bare path (``*.bin`` is read as tokens, anything else as text)."""
        kind, _, rest = text.partition(":")
        if kind == "synthetic":
            return cls(kind="synthetic", **_parse_options(rest, cls))
        if kind == "corpus" and not rest:
            return cls(kind="corpus")
        if kind in WITH_PATH and rest:
            return cls(kind=kind, path=rest)
        path = Path(text)
        if not path.exists():
            raise ValueError(f"--data {text!r}: not 'synthetic', 'corpus', 'text:PATH', 'bin:PATH', 'hf:PATH' "
                             "or an existing path")
        return cls(kind="bin" if path.suffix == ".bin" else "text", path=text)

    def describe(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic order-{self.order} Markov over {self.alphabet} symbols (seed {self.data_seed})"
        if self.kind == "corpus":
            return "bundled corpus (CPython 3.11 stdlib docstrings)"
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
