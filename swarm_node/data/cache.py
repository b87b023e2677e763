"""The files of a prepared dataset on this machine: whole files (verified against the
manifest, served to peers), partial downloads (``NAME.part`` with the verified chunk
indices in ``NAME.have``, so a restart fetches only what it lacks), and a size bound
that evicts shards already trained, oldest first. The host's prepared folder is a
cache holding everything."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from swarm_node.data.manifest import MANIFEST_FILE, FileEntry, Manifest, sha256_hex
from swarm_node.errors import DataError, DiskFull
from swarm_node.system import write_atomic

log = logging.getLogger(__name__)


class ShardCache:
    def __init__(self, root: Path, manifest_sha256: str, *, budget_bytes: int | None = None,
                 trust_whole_files: bool = False):
        self.root = root
        # the host's prepared folder: its files were hashed as they were written, and
        # hashing terabytes again at every start would keep volunteers waiting (peers
        # check every chunk they receive anyway)
        self.trust_whole_files = trust_whole_files
        self.manifest_sha256 = manifest_sha256
        self.budget_bytes = budget_bytes
        self.manifest: Manifest | None = None
        self._verified: set[str] = set()  # whole files hashed in this process
        self._trained: list[str] = []  # eviction order: trained longest ago first

    # -- the manifest ----------------------------------------------------------------
    def load_manifest(self) -> Manifest | None:
        path = self.root / MANIFEST_FILE
        if not path.is_file():
            return None
        try:
            self.manifest = Manifest.from_bytes(path.read_bytes(), expect_sha256=self.manifest_sha256)
        except DataError as exc:
            log.warning("ignoring %s: %s", path, exc)
            return None
        return self.manifest

    def manifest_bytes(self) -> bytes:
        return (self.root / MANIFEST_FILE).read_bytes()

    def store_manifest(self, data: bytes) -> Manifest:
        manifest = Manifest.from_bytes(data, expect_sha256=self.manifest_sha256)
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / MANIFEST_FILE, data)
        self.manifest = manifest
        return manifest

    # -- whole files -----------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.root / name

    def has(self, entry: FileEntry) -> bool:
        """The file is here whole and matches the manifest (hashed once per process)."""
        if entry.name in self._verified:
            return True
        path = self.path(entry.name)
        if not entry.held_in(path, hash_it=False):
            return False
        if not self.trust_whole_files and not entry.held_in(path):
            log.warning("%s differs from the manifest; fetching it again", path)
            path.unlink(missing_ok=True)
            return False
        self._verified.add(entry.name)
        return True

    def whole_files(self) -> list[str]:
        """Names of the manifest's files this cache can serve."""
        if self.manifest is None:
            return []
        return [name for name, entry in self.manifest.files().items() if self.has(entry)]

    def read_chunk(self, entry: FileEntry, index: int) -> bytes:
        start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
        with open(self.path(entry.name), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    # -- partial files ---------------------------------------------------------------
    def verified_chunks(self, entry: FileEntry) -> set[int]:
        """Chunks of a partial download already verified; each is hashed again, since a
        crash may have cut its write short."""
        part, have = self._part(entry), self._have(entry)
        if not part.is_file() or not have.is_file():
            return set()
        try:
            claimed = {i for i in json.loads(have.read_text()) if type(i) is int and 0 <= i < entry.num_chunks()}
        except (json.JSONDecodeError, TypeError):
            return set()
        kept = set()
        with open(part, "rb") as f:
            for index in sorted(claimed):
                start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
                f.seek(start)
                if sha256_hex(f.read(end - start)) == entry.chunks[index]:
                    kept.add(index)
        return kept

    def start_partial(self, entry: FileEntry) -> None:
        self.make_room(entry.bytes, keep={entry.name})
        part = self._part(entry)
        try:
            with open(part, "ab") as f:
                f.truncate(entry.bytes)
        except OSError as exc:
            raise self._disk_error(exc, entry) from None

    def put_chunk(self, entry: FileEntry, index: int, data: bytes, have: set[int]) -> None:
        """Write a chunk that was verified against the manifest, and note it."""
        start, _ = entry.chunk_span(index, self.manifest.chunk_bytes)
        try:
            fd = os.open(self._part(entry), os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
                os.fsync(fd)
            finally:
                os.close(fd)
            have.add(index)
            write_atomic(self._have(entry), json.dumps(sorted(have)).encode())
        except OSError as exc:
            raise self._disk_error(exc, entry) from None

    def finish(self, entry: FileEntry) -> None:
        """All chunks verified: check the whole file, then make it a whole file."""
        part = self._part(entry)
        if sha256_hex(part.read_bytes()) != entry.sha256:  # only if the manifest's chunk hashes lie
            part.unlink(missing_ok=True)
            self._have(entry).unlink(missing_ok=True)
            raise DataError(f"{entry.name}: every chunk matched but the whole file did not; manifest is inconsistent")
        part.replace(self.path(entry.name))
        self._have(entry).unlink(missing_ok=True)
        self._verified.add(entry.name)

    # -- the size bound ----------------------------------------------------------------
    def trained(self, name: str) -> None:
        """A shard this node has trained: the first to go when room is needed."""
        if name in self._trained:
            self._trained.remove(name)
        self._trained.append(name)

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file()) if self.root.is_dir() else 0

    def make_room(self, needed: int, keep: set[str] = frozenset()) -> None:
        """Evict trained shards until ``needed`` more bytes fit the budget; DiskFull when
        they cannot."""
        if self.budget_bytes is None:
            return
        used = self.used_bytes() - self._part_bytes(keep)
        for name in list(self._trained):
            if used + needed <= self.budget_bytes:
                break
            if name in keep:
                continue
            path = self.path(name)
            if path.is_file():
                used -= path.stat().st_size
                path.unlink()
                log.info("data cache: evicted %s (trained) to stay within %.2f GB", name, self.budget_bytes / 1e9)
            self._trained.remove(name)
            self._verified.discard(name)
        if used + needed > self.budget_bytes:
            raise DiskFull(f"the data cache in {self.root} needs {(used + needed) / 1e9:.2f} GB but --data-cache-gb "
                           f"allows {self.budget_bytes / 1e9:.2f}; raise it (nothing verified was deleted)")

    def _part_bytes(self, names: set[str]) -> int:
        total = 0
        for name in names:
            part = self.root / f"{name}.part"
            if part.is_file():
                total += part.stat().st_size
        return total

    def _disk_error(self, exc: OSError, entry: FileEntry) -> Exception:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.root).free
            return DiskFull(f"disk full in {self.root} while fetching {entry.name}: {free / 1e6:.1f} MB free, the "
                            f"shard needs {entry.bytes / 1e6:.1f} MB; free some room (verified chunks are kept)")
        return exc

    def _part(self, entry: FileEntry) -> Path:
        return self.root / f"{entry.name}.part"

    def _have(self, entry: FileEntry) -> Path:
        return self.root / f"{entry.name}.have"

