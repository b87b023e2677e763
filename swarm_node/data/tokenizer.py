"""Tokenizers: byte-level by default (no downloads), or a local Hugging Face
``tokenizers`` JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from swarm_node.errors import ConfigError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` from a local path (needs the optional ``tokenizers`` extra).
    ``setting``: what the user calls the path (a flag or a spec key), for the messages."""

    def __init__(self, path: str | Path, setting: str = "the tokenizer"):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ImportError("a tokenizer.json needs the 'tokenizers' package: "
                              "pip install 'swarm-node[hf-tokenizer]'") from None
        self.path = Path(path)
        if self.path.is_dir():
            raise ConfigError(f"{setting} {self.path} is a folder: give its tokenizer.json file")
        if not self.path.is_file():
            raise FileNotFoundError(f"{setting} {self.path}: tokenizer file not found; give a Hugging Face "
                                    "tokenizer.json")
        try:
            self._tokenizer = _Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust library raises a bare Exception for every kind of bad file
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{setting} {self.path} is not a Hugging Face tokenizer.json ({why}): give "
                              "the model's tokenizer.json (tokenizer.save(PATH) writes one)") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


class AlphabetTokenizer:
    """Display tokenizer for synthetic data: symbol i is shown as a letter."""

    SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [self.SYMBOLS.index(ch) for ch in text if ch in self.SYMBOLS[: self.vocab_size]]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.SYMBOLS[i] if i < len(self.SYMBOLS) else "?" for i in ids)


def load_tokenizer(path: str | Path | None, setting: str = "the tokenizer") -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path, setting)
