"""The manifest of a prepared dataset: the tokenizer file and every shard, with sizes and
SHA-256 hashes of each file and of each fixed-size chunk of it. The run spec names the
manifest by the SHA-256 of its bytes, so the spec's signature covers every token; a
manifest that arrives from a peer is hashed before it is parsed, then parsed as
untrusted input (every field typed and bounded)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm_node.data.shard_format import DTYPE_CODES, DTYPE_NAMES, HEADER_BYTES
from swarm_node.errors import DataError

FORMAT = "swarm-node-data/1"
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_CHUNK_BYTES = 8 << 20
# Files of a manifest, all lists together: what the protocol carries. A `have` answer is
# one bit per file (32 KiB at most), and a manifest of this many one-chunk files (about
# 210 bytes each) still fits MAX_MANIFEST_BYTES; `prepare` refuses a dataset past either.
MAX_SHARDS = 1 << 18
MAX_SOURCES = 16
HEX64 = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
# a cache keeps these beside a file: no file of the manifest may be named like them
SIDECAR_SUFFIXES = (".part", ".have", ".tmp", ".lock")
HASH_BLOCK_BYTES = 1 << 20


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read a block at a time (a shard may not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of the dataset: its name (no folders), length, hash and chunk hashes."""
    name: str
    bytes: int
    sha256: str
    chunks: tuple[str, ...]
    tokens: int = 0  # shards only

    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunk_span(self, index: int, chunk_bytes: int) -> tuple[int, int]:
        start = index * chunk_bytes
        return start, min(self.bytes, start + chunk_bytes)

    def held_in(self, path: Path, *, hash_it: bool = True) -> bool:
        """``path`` is this file: its length, and (``hash_it``) its SHA-256."""
        try:
            if not path.is_file() or path.stat().st_size != self.bytes:
                return False
            return not hash_it or file_sha256(path) == self.sha256
        except FileNotFoundError:  # removed between the looks (another process's cache eviction)
            return False


@dataclass(frozen=True)
class Manifest:
    vocab_size: int
    dtype: str  # u16 or u32
    chunk_bytes: int
    tokenizer: FileEntry | None
    train: tuple[FileEntry, ...]
    val: tuple[FileEntry, ...]
    sources: tuple[str, ...] = ()  # extra HTTP(S) base URLs holding the same files, tried after peers

    def to_bytes(self) -> bytes:
        raw = {"format": FORMAT, "vocab_size": self.vocab_size, "dtype": self.dtype,
               "chunk_bytes": self.chunk_bytes, "tokenizer": _entry_dict(self.tokenizer),
               "train": [_entry_dict(e) for e in self.train], "val": [_entry_dict(e) for e in self.val],
               "sources": list(self.sources)}
        return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> str:
        return sha256_hex(self.to_bytes())

    def files(self) -> dict[str, FileEntry]:
        """Every file by name: what a peer may ask for."""
        entries = [*self.train, *self.val, *([self.tokenizer] if self.tokenizer else [])]
        return {e.name: e for e in entries}

    def train_tokens(self) -> int:
        return sum(e.tokens for e in self.train)

    @classmethod
    def from_bytes(cls, data: bytes, *, expect_sha256: str | None = None) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise DataError(f"manifest of {len(data)} bytes is over the {MAX_MANIFEST_BYTES >> 20} MiB limit")
        if expect_sha256 is not None and sha256_hex(data) != expect_sha256:
            raise DataError(
                f"manifest hash {sha256_hex(data)[:16]}… is not the run spec's {expect_sha256[:16]}…"
            )
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError):  # not UTF-8 or JSON, too deep, or a number past 4,300 digits
            raise DataError("manifest is not JSON") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"not a {FORMAT} manifest")
        vocab = _int(raw.get("vocab_size"), 1, 2**32, "vocab_size")
        dtype = raw.get("dtype")
        if (not isinstance(dtype, str) or dtype not in DTYPE_NAMES
                or vocab > 2 ** (8 * DTYPE_CODES[DTYPE_NAMES[dtype]].itemsize)):
            raise DataError(f"bad token dtype {dtype!r} for a vocabulary of {vocab}")
        chunk_bytes = _int(raw.get("chunk_bytes"), 1024, MAX_CHUNK_BYTES, "chunk_bytes")
        itemsize = DTYPE_CODES[DTYPE_NAMES[dtype]].itemsize

        def entries(key: str) -> tuple[FileEntry, ...]:
            items = raw.get(key)
            if not isinstance(items, list) or len(items) > MAX_SHARDS:
                raise DataError(f"manifest {key} is not a list of shards")
            parsed = tuple(_entry(item, chunk_bytes) for item in items)
            for e in parsed:
                if e.bytes != HEADER_BYTES + e.tokens * itemsize:
                    raise DataError(f"shard {e.name}: {e.bytes} bytes cannot hold {e.tokens} tokens")
            return parsed

        tokenizer = None if raw.get("tokenizer") is None else _entry(raw["tokenizer"], chunk_bytes)
        train, val = entries("train"), entries("val")
        if not train:
            raise DataError("manifest lists no training shards")
        sources = raw.get("sources", [])
        if (not isinstance(sources, list) or len(sources) > MAX_SOURCES
                or not all(isinstance(s, str) and s.startswith(("http://", "https://")) and len(s) < 1024
                           for s in sources)):
            raise DataError("manifest sources must be a short list of http(s) URLs")
        manifest = cls(vocab, dtype, chunk_bytes, tokenizer, train, val, tuple(sources))
        names = [e.name for e in train + val] + ([tokenizer.name] if tokenizer else [])
        if len(names) > MAX_SHARDS:
            raise DataError(
                f"manifest lists {len(names)} files, over the {MAX_SHARDS} the data protocol carries"
            )
        if len(set(names)) != len(names) or MANIFEST_FILE in names:
            raise DataError("manifest names a file twice")
        return manifest


def chunk_hashes(data: bytes | memoryview, chunk_bytes: int) -> tuple[str, ...]:
    view = memoryview(data)
    return tuple(sha256_hex(view[i:i + chunk_bytes]) for i in range(0, max(len(view), 1), chunk_bytes))


def file_entry(name: str, data: bytes, chunk_bytes: int, tokens: int = 0) -> FileEntry:
    return FileEntry(name=name, bytes=len(data), sha256=sha256_hex(data),
                     chunks=chunk_hashes(data, chunk_bytes), tokens=tokens)


def _entry_dict(entry: FileEntry | None) -> dict | None:
    if entry is None:
        return None
    raw = asdict(entry)
    raw["chunks"] = list(entry.chunks)
    return raw


def _entry(raw: object, chunk_bytes: int) -> FileEntry:
    if not isinstance(raw, dict):
        raise DataError("manifest entry is not a map")
    name = raw.get("name")
    if (not isinstance(name, str) or not NAME.fullmatch(name) or name.startswith(".")
            or name.endswith(SIDECAR_SUFFIXES)):
        raise DataError(f"bad file name {str(name)[:40]!r} in the manifest")
    size = _int(raw.get("bytes"), 0, 1 << 40, "bytes")
    tokens = _int(raw.get("tokens", 0), 0, 1 << 40, "tokens")
    digest, chunks = raw.get("sha256"), raw.get("chunks")
    if not isinstance(digest, str) or not HEX64.fullmatch(digest):
        raise DataError(f"{name}: bad sha256")
    want = max(1, math.ceil(size / chunk_bytes))
    if not isinstance(chunks, list) or len(chunks) != want or not all(
            isinstance(c, str) and HEX64.fullmatch(c) for c in chunks):
        raise DataError(f"{name}: needs {want} chunk hashes")
    return FileEntry(name=name, bytes=size, sha256=digest, chunks=tuple(chunks), tokens=tokens)


def _int(value: object, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise DataError(f"manifest {what} {value!r} is not an integer in [{low}, {high}]")
    return value


def local_manifest_sha256(folder: Path) -> str:
    """The hash of the manifest in a prepared folder, after checking it parses."""
    path = folder / MANIFEST_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"no {MANIFEST_FILE} in {folder}: prepare it with `swarm-node data prepare`"
        ) from None
    Manifest.from_bytes(data)
    return sha256_hex(data)
