"""The files of a prepared dataset on this machine: whole files (verified against the
manifest, served to peers), partial downloads (``NAME.part`` with the verified chunk
indices in ``NAME.have``, so a restart fetches only what it lacks), and a size bound
that evicts shards already trained, oldest first. The host's prepared folder is a
cache holding everything.

Nodes of one machine may share a cache: a file is downloaded by one process at a time
(``NAME.lock``, an advisory lock the system drops when its process dies), staging names
are per write, and a file another process evicted is fetched again. A cache a node
writes is private: its folder is made 0700 and refused when another user owns it, and
partial files are never opened through a link."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from swarm_node.data.manifest import MANIFEST_FILE, FileEntry, Manifest, file_sha256, sha256_hex
from swarm_node.errors import DataError, DiskFull
from swarm_node.system import write_atomic

log = logging.getLogger(__name__)

HOLDINGS_REFRESH_S = 5.0  # a `have` answer is recomputed (a stat per file) at most this often
MAX_IN_USE = 8  # files fetched for training and not trained yet, kept from eviction (the latest)
NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class ShardCache:
    def __init__(self, root: Path, manifest_sha256: str, *, budget_bytes: int | None = None,
                 trust_whole_files: bool = False):
        self.root = root
        # the host's prepared folder: its files were hashed as they were written, and
        # hashing terabytes again at every start would keep volunteers waiting; each is
        # hashed once when first served instead (peers check every chunk they receive anyway)
        self.trust_whole_files = trust_whole_files
        self.manifest_sha256 = manifest_sha256
        self.budget_bytes = budget_bytes
        self.manifest: Manifest | None = None
        self._verified: set[str] = set()  # whole files hashed in this process
        self._served: dict[str, bool] = {}  # trusted folder: file hashed at first serve -> it matched
        self._trained: list[str] = []  # eviction order: trained longest ago first
        self._in_use: OrderedDict[str, None] = OrderedDict()  # fetched to train, not trained yet
        self._holdings: tuple[float, bytes] | None = None  # (when, bitmap) of the last `have` answer
        self._root_checked = False

    # -- the folder ------------------------------------------------------------------
    def open_root(self) -> None:
        """Make the cache's folder, private; or check the one there: a folder another
        user owns (a planted one, on a shared disk) is refused, never written into."""
        if self.trust_whole_files or self._root_checked:
            return
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self.root.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(self.root)
            if not stat.S_ISDIR(info.st_mode):
                raise DataError(f"the data cache {self.root} is not a folder (a link?): remove it, or pass "
                                "--data-cache with a folder of your own")
            if info.st_uid != os.geteuid():
                raise DataError(
                    f"the data cache {self.root} belongs to another user: pass --data-cache with a "
                    "folder of your own"
                )
            if info.st_mode & 0o077:
                os.chmod(self.root, 0o700)
        except OSError as exc:
            raise DataError(
                f"cannot use {self.root} as the data cache ({exc.strerror or exc}): pass --data-cache "
                "with a folder you can write"
            ) from None
        self._root_checked = True

    # -- the manifest ----------------------------------------------------------------
    def load_manifest(self) -> Manifest | None:
        path = self.root / MANIFEST_FILE
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        try:
            self.manifest = Manifest.from_bytes(data, expect_sha256=self.manifest_sha256)
        except DataError as exc:
            log.warning("ignoring %s: %s", path, exc)
            return None
        return self.manifest

    def manifest_bytes(self) -> bytes:
        return (self.root / MANIFEST_FILE).read_bytes()

    def store_manifest(self, data: bytes, manifest: Manifest | None = None) -> Manifest:
        """Keep the run's manifest (``manifest``: ``data`` parsed already). A disk that
        refuses it ends in one line (DataError), not a traceback."""
        manifest = manifest or Manifest.from_bytes(data, expect_sha256=self.manifest_sha256)
        self.open_root()
        try:
            write_atomic(self.root / MANIFEST_FILE, data)
        except OSError as exc:
            raise self._disk_error(exc, MANIFEST_FILE, len(data)) from None
        self.manifest = manifest
        return manifest

    # -- whole files -----------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.root / name

    def has(self, entry: FileEntry) -> bool:
        """The file is here whole and matches the manifest (hashed once per process; a
        file another process evicted since is noticed by its size)."""
        path = self.path(entry.name)
        if entry.name in self._verified:
            if entry.held_in(path, hash_it=False):
                return True
            self._verified.discard(entry.name)
        if not entry.held_in(path, hash_it=False):
            return False
        if not self.trust_whole_files and not entry.held_in(path):
            log.warning("%s differs from the manifest; fetching it again", path)
            path.unlink(missing_ok=True)
            return False
        self._verified.add(entry.name)
        return True

    def servable(self, entry: FileEntry) -> bool:
        """``has``, and in a trusted folder the file hashed once, at its first serve: a
        damaged file is logged once and not served (nor listed), the others still are."""
        if not self.has(entry):
            return False
        if not self.trust_whole_files:
            return True
        matched = self._served.get(entry.name)
        if matched is None:
            matched = self._served[entry.name] = entry.held_in(self.path(entry.name))
            if not matched:
                log.warning("%s differs from the manifest: not serving it (prepare the dataset again)",
                            self.path(entry.name))
                self._holdings = None
        return matched

    def whole_files(self) -> list[str]:
        """Names of the manifest's files this cache can serve."""
        if self.manifest is None:
            return []
        return [name for name, entry in self.manifest.files().items()
                if self._served.get(name) is not False and self.has(entry)]

    def holdings(self) -> bytes:
        """The files held whole as a bitmap over the manifest's file order (bit i of
        byte i // 8, least significant first), recomputed at most every few seconds."""
        now = time.monotonic()
        if self._holdings is not None and now - self._holdings[0] < HOLDINGS_REFRESH_S:
            return self._holdings[1]
        files = list(self.manifest.files()) if self.manifest is not None else []
        held = set(self.whole_files())
        bits = np.packbits(np.array([name in held for name in files], dtype=bool), bitorder="little")
        self._holdings = (now, bits.tobytes())
        return self._holdings[1]

    def read_chunk(self, entry: FileEntry, index: int) -> bytes:
        start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
        with open(self.path(entry.name), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    # -- downloads shared by the processes of a machine ------------------------------
    def try_lock(self, entry: FileEntry) -> int | None:
        """The right to download ``entry`` (a descriptor to hand to ``unlock``), or None
        while another process (or fetcher) downloads it."""
        self.open_root()
        try:
            fd = os.open(self.root / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT | NO_FOLLOW, 0o600)
        except OSError as exc:
            raise self._disk_error(exc, entry.name, entry.bytes) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        os.close(fd)

    # -- partial files ---------------------------------------------------------------
    def verified_chunks(self, entry: FileEntry) -> set[int]:
        """Chunks of a partial download already verified; each is hashed again, since a
        crash may have cut its write short."""
        part, have = self._part(entry), self._have(entry)
        try:
            claimed = {
                i for i in json.loads(have.read_bytes()) if type(i) is int and 0 <= i < entry.num_chunks()
            }
            kept = set()
            with open(part, "rb") as f:
                for index in sorted(claimed):
                    start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
                    f.seek(start)
                    if sha256_hex(f.read(end - start)) == entry.chunks[index]:
                        kept.add(index)
        except (OSError, ValueError, TypeError):  # absent, not JSON (or not UTF-8), not a list
            return set()
        return kept

    def start_partial(self, entry: FileEntry) -> None:
        self.open_root()
        self.make_room(entry.bytes, keep={entry.name})
        part = self._part(entry)
        try:
            if part.is_symlink():
                part.unlink()
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | NO_FOLLOW, 0o600)
            try:
                if os.fstat(fd).st_size != entry.bytes:
                    os.ftruncate(fd, entry.bytes)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._disk_error(exc, entry.name, entry.bytes) from None

    def put_chunk(self, entry: FileEntry, index: int, data: bytes, have: set[int]) -> None:
        """Write a chunk that was verified against the manifest, note it on disk, then in
        ``have`` (last: a ``have`` that lists every chunk means every write is done)."""
        start, _ = entry.chunk_span(index, self.manifest.chunk_bytes)
        try:
            fd = os.open(self._part(entry), os.O_WRONLY | NO_FOLLOW)
            try:
                os.pwrite(fd, data, start)
                os.fsync(fd)
            finally:
                os.close(fd)
            write_atomic(self._have(entry), json.dumps(sorted(have | {index})).encode())
        except OSError as exc:
            raise self._disk_error(exc, entry.name, entry.bytes) from None
        have.add(index)

    def finish(self, entry: FileEntry) -> None:
        """All chunks verified: check the whole file, then make it a whole file."""
        part = self._part(entry)
        if file_sha256(part) != entry.sha256:  # only if the manifest's chunk hashes lie
            part.unlink(missing_ok=True)
            self._have(entry).unlink(missing_ok=True)
            raise DataError(
                f"{entry.name}: every chunk matched but the whole file did not; manifest is inconsistent"
            )
        part.replace(self.path(entry.name))
        self._have(entry).unlink(missing_ok=True)
        self._verified.add(entry.name)
        self._holdings = None

    # -- the size bound ----------------------------------------------------------------
    def in_use(self, name: str) -> None:
        """A file fetched to be trained: kept while it is among the latest such."""
        self._in_use.pop(name, None)
        self._in_use[name] = None
        while len(self._in_use) > MAX_IN_USE:
            self._in_use.popitem(last=False)

    def trained(self, name: str) -> None:
        """A shard this node has trained: the first to go when room is needed."""
        self._in_use.pop(name, None)
        if name in self._trained:
            self._trained.remove(name)
        self._trained.append(name)

    def used_bytes(self) -> int:
        total = 0
        try:
            for path in self.root.iterdir():
                try:
                    info = path.lstat()
                except FileNotFoundError:  # another process's rename or eviction
                    continue
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0
        except FileNotFoundError:
            return 0
        return total

    def make_room(self, needed: int, keep: set[str] = frozenset()) -> None:
        """Evict until ``needed`` more bytes fit the budget: shards trained here, oldest
        first; then whole files this process is not about to train (left by an earlier
        run, or by another node sharing the cache), oldest first. DiskFull when that is
        not enough."""
        if self.budget_bytes is None:
            return
        used = self.used_bytes() - self._part_bytes(keep)
        for name in self._eviction_order(keep):
            if used + needed <= self.budget_bytes:
                break
            path = self.path(name)
            try:
                size = path.lstat().st_size
                path.unlink()
                used -= size
                log.info("data cache: evicted %s to stay within %.2f GB", name, self.budget_bytes / 1e9)
            except FileNotFoundError:
                pass
            if name in self._trained:
                self._trained.remove(name)
            self._verified.discard(name)
            self._holdings = None
        if used + needed > self.budget_bytes:
            raise DiskFull(
                f"the data cache in {self.root} needs {(used + needed) / 1e9:.2f} GB but --data-cache-gb "
                f"allows {self.budget_bytes / 1e9:.2f}; raise it (nothing verified was deleted)"
            )

    def _eviction_order(self, keep: set[str]) -> list[str]:
        trained = [n for n in self._trained if n not in keep]
        if self.manifest is None:
            return trained
        spared = set(keep) | set(self._in_use) | set(trained)
        if self.manifest.tokenizer is not None:
            spared.add(self.manifest.tokenizer.name)
        others = []
        for entry in self.manifest.train + self.manifest.val:
            if entry.name not in spared:
                try:
                    info = self.path(entry.name).lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    others.append((info.st_mtime, entry.name))
        return trained + [name for _, name in sorted(others)]

    def _part_bytes(self, names: set[str]) -> int:
        total = 0
        for name in names:
            try:
                total += (self.root / f"{name}.part").lstat().st_size
            except FileNotFoundError:
                pass
        return total

    def _disk_error(self, exc: OSError, name: str, nbytes: int) -> DataError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.root if self.root.is_dir() else self.root.parent).free
            what = "the manifest" if name == MANIFEST_FILE else "the shard"
            return DiskFull(
                f"disk full in {self.root} while fetching {name}: {free / 1e6:.1f} MB free, {what} "
                f"needs {nbytes / 1e6:.1f} MB; free some room (verified chunks are kept)"
            )
        return DataError(
            f"cannot write {name} into the data cache {self.root} ({exc.strerror or exc}): check "
            "the folder's permissions, or pass --data-cache with another"
        )

    def _part(self, entry: FileEntry) -> Path:
        return self.root / f"{entry.name}.part"

    def _have(self, entry: FileEntry) -> Path:
        return self.root / f"{entry.name}.have"
