"""Fetching a prepared dataset: the manifest, then whole files chunk by chunk from
several sources at once, every chunk checked against the manifest before it is written.

The manifest comes from the initial peers (the bootstrap) first, all asked at once: they
always hold it. Only when none serves it are verified peers asked (and one peer nobody
verified), all at once, the first good answer taken.

A file comes from peers that hold it (data/holders.py: asked which files they hold,
remembered for a minute; verified peers first, at most one peer nobody verified), else
from the initial peers, else from the manifest's HTTP(S) mirrors. The initial peers
stay a source whatever others claim: when no chunk has come for HEDGE_S, or every
source of a file let it down, they join the file. Once no chunk is left to hand out,
an idle source also asks for the chunks others still owe, so a source that stalls holds
up nothing. What each source is held to is in data/sources.py."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from swarm_node.data.cache import ShardCache
from swarm_node.data.holders import MAX_PROBES, Holders
from swarm_node.data.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, sha256_hex
from swarm_node.data.mirror import MirrorRefused, http_range
from swarm_node.data.serve import data_request
from swarm_node.data.sources import FetchStats, SourceBook, is_mirror, short_source
from swarm_node.errors import DataError, PeerError, PeerRefused, PeerTimeout, ProtocolError, SwarmError
from swarm_node.net import protocols
from swarm_node.net.transport import Requester, short_id
from swarm_node.wire.frames import FrameLimits, decode_frame

log = logging.getLogger(__name__)

MAX_MANIFEST_PEERS = 4  # verified peers asked at once for the manifest when no initial peer serves it
MAX_SOURCES = 4  # sources one file is fetched from at once
HEDGE_S = 10.0  # no chunk of a file for this long: one more source joins it
RETRY_S = (1.0, 15.0)  # pause before asking again when no source had a file: first, most
LOCK_POLL_S = 0.5  # how often a file another process is fetching into a shared cache is looked at


@dataclass
class _Job:
    """One file's download: what is verified, what nobody is asked for, what is asked of whom."""
    entry: FileEntry
    have: set[int]
    missing: deque
    outstanding: dict[int, set[str]] = field(default_factory=dict)  # chunk -> sources asked for it now
    asked_at: dict[str, float] = field(default_factory=dict)  # source -> when it was asked its chunk
    used: set[str] = field(default_factory=set)

    def complete(self) -> bool:
        return len(self.have) >= self.entry.num_chunks()

    def next_for(self, source: str) -> int | None:
        """A chunk nobody is asked for; else one another source owes (the fewest asked first)."""
        while self.missing:
            index = self.missing.popleft()
            if index not in self.have:
                return index
        owed = [i for i, asked in self.outstanding.items() if i not in self.have and source not in asked]
        return min(owed, key=lambda i: len(self.outstanding[i])) if owed else None

    def give_back(self, index: int) -> None:
        if index not in self.have and index not in self.outstanding and index not in self.missing:
            self.missing.append(index)


class DataFetcher:
    def __init__(self, cache: ShardCache, transport: Requester, *, peers: Callable[[], list[str]],
                 initial: list[str], on_fault: Callable[[str, str], None] = lambda peer, why: None,
                 timeout_s: float = 30.0, progress: bool = True, rng: random.Random | None = None,
                 verified: Callable[[str], bool] = lambda peer: False, private_mirrors: bool = False):
        self.cache = cache
        self.transport = transport
        self.peers = peers  # live peers of the run, any stage
        self.initial = list(initial)  # the bootstrap(s)
        self.verified = verified  # peers known to exist (they answered us, or we served them)
        self.timeout_s = timeout_s
        self.progress = progress
        self.private_mirrors = private_mirrors
        self.rng = rng or random.Random()
        self.book = SourceBook(self.initial, on_fault, clock=_now)
        self.holders = Holders(call=self._call, bytes_of=_bytes_of, book=self.book,
                               manifest=lambda: self.manifest,
                               manifest_sha256=cache.manifest_sha256, peers=peers, initial=self.initial,
                               verified=verified, rng=self.rng, clock=_now)
        self._have_lock = asyncio.Lock()
        self._downloads: dict[str, asyncio.Task] = {}

    @property
    def manifest(self) -> Manifest | None:
        return self.cache.manifest

    @property
    def stats(self) -> FetchStats:
        return self.book.stats

    # -- the manifest ----------------------------------------------------------------
    async def fetch_manifest(self, timeout_s: float = 600.0) -> Manifest:
        """From the cache, else from the initial peers, else from verified peers, asking
        again until ``timeout_s`` has passed."""
        loaded = await asyncio.to_thread(self.cache.load_manifest)
        if loaded is not None:
            return loaded
        pause, deadline = RETRY_S[0], _now() + timeout_s
        while True:
            for group in (self.initial, self._manifest_peers()):
                found = await self._manifest_from(group, deadline)
                if found is not None:
                    peer, manifest, data = found
                    await asyncio.to_thread(self.cache.store_manifest, data, manifest)
                    self.book.delivered(peer, len(data))
                    log.info("data: manifest of %d training shards (%.1f M tokens) from %s",
                             len(manifest.train),
                             manifest.train_tokens() / 1e6, short_id(peer))
                    return manifest
            if _now() + pause > deadline:
                raise DataError(
                    f"no peer served this run's dataset manifest ({self.cache.manifest_sha256[:16]}…) "
                    f"within {timeout_s:.0f} s: the host serves it with `swarm-bootstrap --data DIR`; "
                    "check that it does, or join again later"
                )
            log.info("data: no peer served the manifest yet; asking again in %.0f s", pause)
            await asyncio.sleep(pause)
            pause = min(RETRY_S[1], pause * 2)

    def _manifest_peers(self) -> list[str]:
        others = [p for p in self.holders.candidates() if p not in self.initial]
        self.rng.shuffle(others)
        verified = [p for p in others if self.holders.is_verified(p)][:MAX_MANIFEST_PEERS]
        unverified = [p for p in others if not self.holders.is_verified(p)]
        return verified + unverified[:MAX_PROBES]

    async def _manifest_from(self, peers: list[str], deadline: float) -> tuple[str, Manifest, bytes] | None:
        """The first good manifest of ``peers``, all asked at once."""
        peers = [p for p in peers if not self.book.is_refused(p)]
        if not peers or _now() >= deadline:
            return None
        tasks = [asyncio.create_task(self._ask_manifest(p, deadline)) for p in peers]
        try:
            for next_done in asyncio.as_completed(tasks):
                found = await next_done
                if found is not None:
                    return found
            return None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _ask_manifest(self, peer: str, deadline: float) -> tuple[str, Manifest, bytes] | None:
        request = data_request(self.cache.manifest_sha256, "manifest")
        try:
            data = await self._ask_bytes(peer, request, max_bytes=MAX_MANIFEST_BYTES + 4096,
                                         timeout_s=min(self.timeout_s, deadline - _now()))
        except (ProtocolError, TypeError, ValueError, RuntimeError) as exc:
            self.book.refuse(peer, f"sent a malformed data answer ({exc})")
            return None
        except PeerError:
            return None
        if data is None:
            return None
        try:
            manifest = await asyncio.to_thread(Manifest.from_bytes, data,
                                               expect_sha256=self.cache.manifest_sha256)
        except DataError as exc:
            self.book.refuse(peer, f"served a manifest that is not the run's ({exc})")
            return None
        return peer, manifest, data

    # -- whole files -----------------------------------------------------------------
    async def fetch(self, entry: FileEntry) -> Path:
        """``entry`` here whole and verified; resumes what an earlier run verified. One
        download per file: a second caller (training catching up with the prefetch)
        waits for the first, and so does another node sharing this cache."""
        self.cache.in_use(entry.name)
        task = self._downloads.get(entry.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._download(entry))
            self._downloads[entry.name] = task
            task.add_done_callback(lambda _: self._downloads.pop(entry.name, None))
        return await asyncio.shield(task)

    async def close(self) -> None:
        tasks = list(self._downloads.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _download(self, entry: FileEntry) -> Path:
        cache = self.cache
        if await asyncio.to_thread(cache.has, entry):
            return cache.path(entry.name)
        lock = await self._lock(entry)
        try:
            if await asyncio.to_thread(cache.has, entry):  # another node sharing the cache fetched it
                return cache.path(entry.name)
            have = await asyncio.to_thread(cache.verified_chunks, entry)
            await asyncio.to_thread(cache.start_partial, entry)
            if have:
                log.info("data: resuming %s with %d of %d chunks verified", entry.name, len(have),
                         entry.num_chunks())
            job = _Job(entry, have, deque(i for i in range(entry.num_chunks()) if i not in have))
            started, already = _now(), len(have)
            already_bytes = sum(self._chunk_len(entry, i) for i in have)
            bar = tqdm(total=entry.bytes, initial=already_bytes, unit="B", unit_scale=True,
                       desc=f"fetching {entry.name}", disable=not self.progress, leave=False,
                       dynamic_ncols=True)
            try:
                await self._fetch_chunks(job, bar)
            finally:
                bar.close()
            await asyncio.to_thread(cache.finish, entry)
        finally:
            cache.unlock(lock)
        took = _now() - started
        got = entry.bytes - already_bytes
        log.info("data: %s verified (%d of %d chunks fetched now, %.1f MB in %.1f s, %.1f MB/s, from %s)",
                 entry.name, entry.num_chunks() - already, entry.num_chunks(), got / 1e6, took,
                 got / 1e6 / max(took, 1e-3), ", ".join(sorted(map(short_source, job.used))))
        return cache.path(entry.name)

    async def _lock(self, entry: FileEntry) -> int:
        noted = False
        while (lock := await asyncio.to_thread(self.cache.try_lock, entry)) is None:
            if not noted:
                log.info("data: another node sharing this cache is fetching %s; waiting for it", entry.name)
                noted = True
            await asyncio.sleep(LOCK_POLL_S)
        return lock

    async def _fetch_chunks(self, job: _Job, bar) -> None:
        entry, pause = job.entry, RETRY_S[0]
        drains: dict[asyncio.Task, str] = {}
        finished = False
        try:
            while not job.complete():
                if not drains:
                    sources = await self._sources_for(entry)
                    if not sources:
                        log.info("data: no source holds %s yet; asking again in %.0f s", entry.name, pause)
                        await asyncio.sleep(pause)
                        pause = min(RETRY_S[1], pause * 2)
                        continue
                    for source in sources:
                        self._start_drain(drains, source, job, bar)
                before = len(job.have)
                done, _ = await asyncio.wait(drains, timeout=HEDGE_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    drains.pop(task)
                    task.result()  # what ends a drain by raising is ours (a full disk): it ends the download
                if not done and len(job.have) == before and not job.complete():
                    extra = await self._standby(entry, set(drains.values()))
                    if extra is not None:
                        self._start_drain(drains, extra, job, bar)
            finished = True
        finally:
            now = _now()
            for task, source in drains.items():
                asked = job.asked_at.get(source)
                if finished and asked is not None and now - asked >= HEDGE_S:
                    self.book.let_down(source, entry.name, f"stalled on a chunk of {entry.name}")
                task.cancel()
            await asyncio.gather(*drains, return_exceptions=True)

    def _start_drain(self, drains: dict, source: str, job: _Job, bar) -> None:
        job.used.add(source)
        drains[asyncio.create_task(self._drain(source, job, bar))] = source

    async def _drain(self, source: str, job: _Job, bar) -> None:
        """Fetch chunks of ``job`` from ``source`` until none is left or it lets us down."""
        entry = job.entry
        while (index := job.next_for(source)) is not None:
            job.outstanding.setdefault(index, set()).add(source)
            job.asked_at[source] = _now()
            failure: BaseException | None = None
            data = None
            try:
                data = await self._chunk(source, entry, index)
            except (PeerError, TypeError, ValueError, RuntimeError) as exc:  # what a remote answer can raise
                failure = exc
            finally:
                asked = job.outstanding.get(index, set())
                asked.discard(source)
                if not asked:
                    job.outstanding.pop(index, None)
                job.asked_at.pop(source, None)
            if failure is not None or data is None or sha256_hex(data) != entry.chunks[index]:
                job.give_back(index)
                self._let_down(source, entry.name, failure, data)
                return
            async with self._have_lock:
                if index in job.have:  # another source owed it too, and was first
                    continue
                await asyncio.to_thread(self.cache.put_chunk, entry, index, data, job.have)
            self.holders.answered(source)
            self.book.delivered(source, len(data))
            bar.update(len(data))

    def _let_down(self, source: str, name: str, failure: BaseException | None, data: bytes | None) -> None:
        book = self.book
        if failure is None and data is None:
            book.let_down(source, name,
                          "does not have it" if is_mirror(source) else "said it does not hold it")
        elif failure is None:
            book.lied(source, name, f"served bytes of {name} that the manifest does not know")
        elif isinstance(failure, PeerRefused):
            book.let_down(source, name, "busy", busy=True)
        elif isinstance(failure, PeerTimeout):
            book.let_down(source, name, f"stalled on a chunk of {name}")
        elif isinstance(failure, MirrorRefused):
            book.refuse(source, str(failure))
        elif isinstance(failure, ProtocolError) or not isinstance(failure, SwarmError):
            book.lied(source, name, f"sent a malformed data answer ({failure})")
        else:
            book.let_down(source, name, f"failed ({failure})")

    async def _chunk(self, source: str, entry: FileEntry, index: int) -> bytes | None:
        if is_mirror(source):
            start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
            return await asyncio.to_thread(http_range, source, entry.name, start, end,
                                           timeout_s=self.timeout_s, private_ok=self.private_mirrors)
        return await self._ask_bytes(source,
                                     data_request(self.cache.manifest_sha256, "chunk", entry.name, index),
                                     max_bytes=self.manifest.chunk_bytes + 4096)

    # -- who holds what --------------------------------------------------------------
    async def _sources_for(self, entry: FileEntry) -> list[str]:
        """Peers holding ``entry`` (verified first); the initial peers only when no
        other peer does, since the host's uplink is what every volunteer shares; the
        HTTP mirrors when no peer at all does."""
        await self.holders.refresh()
        holders = self.holders.of(entry, initial=False)
        if holders:
            return holders[:MAX_SOURCES]
        hosts = self.holders.of(entry, initial=True)
        if hosts:
            return hosts[:MAX_SOURCES]
        return self._mirrors(entry)[:MAX_SOURCES]

    async def _standby(self, entry: FileEntry, running: set[str]) -> str | None:
        """One more source for a file whose sources stall: an initial peer first."""
        await self.holders.refresh()
        for source in (self.holders.of(entry, initial=True) + self.holders.of(entry, initial=False)
                       + self._mirrors(entry)):
            if source not in running:
                return source
        return None

    def _mirrors(self, entry: FileEntry) -> list[str]:
        return [url for url in self.manifest.sources if self.book.usable(url, entry.name)]

    # -- one call --------------------------------------------------------------------
    async def _ask_bytes(self, peer: str, request: bytes, *, max_bytes: int,
                         timeout_s: float | None = None) -> bytes | None:
        """The answer's bytes; None when the peer does not hold them; PeerRefused when
        it is busy."""
        header, tensors = await self._call(peer, request, max_bytes, timeout_s)
        if not header.get("ok"):
            if header.get("error") == "busy":
                raise PeerRefused(f"{short_id(peer)} is busy")
            return None
        return _bytes_of(tensors)

    async def _call(self, peer: str, request: bytes, max_bytes: int,
                    timeout_s: float | None = None) -> tuple[dict, list]:
        answer = await self.transport.request(peer, protocols.DATA, request,
                                              timeout_s=timeout_s or self.timeout_s,
                                              max_response_bytes=max_bytes, paced_response=True)
        return decode_frame(answer, FrameLimits(max_payload_bytes=max_bytes, max_tensors=1))

    def _chunk_len(self, entry: FileEntry, index: int) -> int:
        start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
        return end - start


def _bytes_of(tensors: list) -> bytes:
    """The one byte string a data answer carries (a 1-D uint8 tensor, or none)."""
    if not tensors:
        return b""
    if len(tensors) > 1 or tensors[0].dim() != 1 or tensors[0].dtype != torch.uint8:
        raise ProtocolError("a data answer carries one byte string (a 1-D uint8 tensor)")
    return tensors[0].numpy().tobytes()


def _now() -> float:
    return asyncio.get_running_loop().time()
