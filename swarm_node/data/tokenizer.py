"""Tokenizers: byte-level by default (no downloads), or a local Hugging Face
``tokenizers`` JSON file, given by its path or by its model's name in this machine's
Hugging Face cache (``tokenizer_file``: nothing is ever downloaded).

A prepared dataset's documents each end with the tokenizer's end-of-text token where
its vocabulary has one (a BPE that `data prepare` trains always does; GPT-2's, Llama's
do), else with a blank line (``encode_document``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from swarm_node.errors import ConfigError

DOC_SEPARATOR = "\n\n"  # ends a document where the vocabulary has no end-of-text token
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>")  # GPT-2's and ours, Llama 3's, Llama 2's
# A Hugging Face model id, ORG/NAME or NAME, and an optional @REVISION (a branch, tag or commit).
HF_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?:@(?P<revision>[\w./-]+))?")


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

    def encode_document(self, text: str) -> list[int]:
        return self.encode(text + DOC_SEPARATOR)


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
        found = (self._tokenizer.token_to_id(name) for name in END_OF_TEXT_TOKENS)
        self.end_of_text: int | None = next((i for i in found if i is not None), None)
        self._as_text = None  # encodes the spelling of a special token as text (encode_document)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        """A document of a prepared dataset: its text, then the end-of-text token (a blank
        line without one). Text that spells a special token is encoded as text, so only
        real document ends carry the token."""
        if self.end_of_text is None:
            return self.encode(text + DOC_SEPARATOR)
        if self._as_text is None:
            from tokenizers import Tokenizer as _Tokenizer

            self._as_text = _Tokenizer.from_file(str(self.path))
            try:
                self._as_text.encode_special_tokens = True
            except AttributeError:  # tokenizers before 0.15.1 always match special tokens in text
                pass
        return self._as_text.encode(text, add_special_tokens=False).ids + [self.end_of_text]

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


def hf_hub_cache() -> Path:
    """Where Hugging Face programs keep downloaded models, by the same variables they read."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def tokenizer_file(given: str | Path, setting: str = "--tokenizer") -> Path:
    """The tokenizer.json that ``given`` names: a file, or where it is no file and reads as
    a model id (``gpt2``, ``ORG/NAME``, ``NAME@REVISION``), that model's tokenizer.json in
    the local Hugging Face cache. FileNotFoundError where neither holds one."""
    path = Path(given)
    text = str(given)
    if path.exists() or text.endswith(".json") or not HF_NAME.fullmatch(text):
        return path  # HFTokenizer says what is wrong with a path
    name = HF_NAME.fullmatch(text)
    cache = hf_hub_cache()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise ImportError(f"{setting} {text}: a tokenizer by name needs the 'huggingface_hub' package: "
                          "pip install 'swarm-node[hf-tokenizer]'") from None
    found = try_to_load_from_cache(name["repo"], "tokenizer.json", cache_dir=cache, revision=name["revision"])
    if isinstance(found, str) and Path(found).is_file():
        return Path(found)
    raise FileNotFoundError(
        f"{setting} {text}: no such file, and no tokenizer.json of a Hugging Face model "
        f"{text} in the cache {cache} (nothing is downloaded here): give the tokenizer.json "
        f"file, or fetch it where there is a network with `hf download {name['repo']} "
        "tokenizer.json`"
    )
