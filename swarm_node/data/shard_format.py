"""Token shard files: a fixed 32-byte header, then the token ids, little endian.

    header := magic "SWTOKSH1" | u8 dtype (1: uint16, 2: uint32) | 3 zero bytes
              | u32 vocabulary size | u64 token count | 8 zero bytes

The header is checked on every open against the file's length and the manifest's
vocabulary, so a truncated or foreign file is refused before a single window is read."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from swarm_node.errors import DataError

MAGIC = b"SWTOKSH1"
HEADER = struct.Struct("<8sB3xIQ8x")
HEADER_BYTES = HEADER.size  # 32: the tokens start aligned for either dtype
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
DTYPE_NAMES = {"u16": 1, "u32": 2}


def dtype_for_vocab(vocab_size: int) -> str:
    if not 0 < vocab_size <= 2**32:
        raise DataError(f"a vocabulary of {vocab_size} tokens does not fit 32-bit token ids")
    return "u16" if vocab_size <= 2**16 else "u32"


def shard_bytes(tokens: np.ndarray, vocab_size: int) -> bytes:
    """A whole shard file for ``tokens``."""
    code = DTYPE_NAMES[dtype_for_vocab(vocab_size)]
    body = np.ascontiguousarray(tokens, dtype=DTYPE_CODES[code]).tobytes()
    return HEADER.pack(MAGIC, code, vocab_size, len(tokens)) + body


def parse_header(head: bytes, file_bytes: int, *, vocab_size: int | None = None) -> tuple[np.dtype, int, int]:
    """(dtype, vocabulary, token count) of a shard whose first bytes are ``head`` and whose
    length is ``file_bytes``; DataError if anything disagrees."""
    if len(head) < HEADER_BYTES:
        raise DataError(f"shard is {file_bytes} bytes, shorter than its {HEADER_BYTES}-byte header")
    magic, code, vocab, count = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise DataError("not a token shard (bad magic)")
    if code not in DTYPE_CODES:
        raise DataError(f"unknown token dtype code {code}")
    dtype = DTYPE_CODES[code]
    if vocab_size is not None and vocab != vocab_size:
        raise DataError(f"shard vocabulary {vocab} is not the manifest's {vocab_size}")
    if file_bytes != HEADER_BYTES + count * dtype.itemsize:
        raise DataError(f"shard declares {count} tokens but holds {file_bytes - HEADER_BYTES} bytes of them")
    return dtype, vocab, count


def open_shard(path: Path, *, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of a shard file, memory-mapped read-only."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"shard file not found: {path}") from None
    try:
        dtype, _, count = parse_header(head, size, vocab_size=vocab_size)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
