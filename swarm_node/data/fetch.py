"""Fetching a prepared dataset: the manifest, then whole files chunk by chunk from
several sources at once, every chunk checked against the manifest before it is written.

Sources, in order of preference: peers that hold the file (asked which files they hold,
remembered for a minute), else the initial peers (the bootstrap), else the manifest's
HTTP(S) mirrors. A source that sends bytes the manifest does not know is refused for
the rest of the run, counted against it, and logged once; its chunk goes to another
source. A source that is slow or gone is dropped for this file only."""

from __future__ import annotations

import asyncio
import http.client
import logging
import random
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from swarm_node.data.cache import ShardCache
from swarm_node.data.manifest import FileEntry, Manifest, sha256_hex
from swarm_node.data.serve import data_request
from swarm_node.errors import DataError, PeerError, ProtocolError, known_failure
from swarm_node.net import protocols
from swarm_node.net.transport import Requester, short_id
from swarm_node.wire.frames import FrameLimits, decode_frame

log = logging.getLogger(__name__)

HOLDINGS_TTL_S = 60.0
MAX_ASKED = 16  # peers asked at once which files they hold
MAX_SOURCES = 4  # sources one file is fetched from at once
RETRY_S = (1.0, 15.0)  # pause before asking again when no source had a file: first, most


@dataclass
class FetchStats:
    fetched_bytes: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)


class DataFetcher:
    def __init__(self, cache: ShardCache, transport: Requester, *, peers: Callable[[], list[str]],
                 initial: list[str], on_fault: Callable[[str, str], None] = lambda peer, why: None,
                 timeout_s: float = 30.0, progress: bool = True, rng: random.Random | None = None):
        self.cache = cache
        self.transport = transport
        self.peers = peers  # live peers of the run, any stage
        self.initial = list(initial)  # the bootstrap(s): asked after peers
        self.on_fault = on_fault
        self.timeout_s = timeout_s
        self.progress = progress
        self.rng = rng or random.Random()
        self.stats = FetchStats()
        self._holdings: dict[str, tuple[float, frozenset[str]]] = {}
        self._have_lock = asyncio.Lock()
        self._downloads: dict[str, asyncio.Task] = {}

    @property
    def manifest(self) -> Manifest | None:
        return self.cache.manifest

    # -- the manifest ----------------------------------------------------------------
    async def fetch_manifest(self, timeout_s: float = 600.0) -> Manifest:
        """From the cache, else from the first peer that serves it, asking again until
        ``timeout_s`` has passed."""
        loaded = await asyncio.to_thread(self.cache.load_manifest)
        if loaded is not None:
            return loaded
        pause, deadline = RETRY_S[0], time.monotonic() + timeout_s
        while True:
            for peer in self._candidates():
                try:
                    data = await self._ask_bytes(peer, data_request(self.cache.manifest_sha256, "manifest"),
                                                 max_bytes=64 << 20)
                except PeerError:
                    continue
                if data is None:
                    continue
                try:
                    manifest = await asyncio.to_thread(self.cache.store_manifest, data)
                except DataError as exc:
                    self._refuse(peer, f"served a manifest that is not the run's ({exc})")
                    continue
                self._count(peer, len(data))
                log.info("data: manifest of %d training shards (%.1f M tokens) from %s", len(manifest.train),
                         manifest.train_tokens() / 1e6, short_id(peer))
                return manifest
            if time.monotonic() + pause > deadline:
                raise DataError(f"no peer served this run's dataset manifest ({self.cache.manifest_sha256[:16]}…) "
                                f"within {timeout_s:.0f} s: the host serves it with `swarm-bootstrap --data DIR`; "
                                "check that it does, or join again later")
            log.info("data: no peer served the manifest yet; asking again in %.0f s", pause)
            await asyncio.sleep(pause)
            pause = min(RETRY_S[1], pause * 2)

    # -- whole files -----------------------------------------------------------------
    async def fetch(self, entry: FileEntry) -> Path:
        """``entry`` here whole and verified; resumes what an earlier run verified. One
        download per file: a second caller (training catching up with the prefetch)
        waits for the first."""
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
        have = await asyncio.to_thread(cache.verified_chunks, entry)
        await asyncio.to_thread(cache.start_partial, entry)
        if have:
            log.info("data: resuming %s with %d of %d chunks verified", entry.name, len(have), entry.num_chunks())
        missing = deque(i for i in range(entry.num_chunks()) if i not in have)
        started, already = time.monotonic(), len(have)
        already_bytes = sum(self._chunk_len(entry, i) for i in have)
        bar = tqdm(total=entry.bytes, initial=already_bytes, unit="B",
                   unit_scale=True, desc=f"fetching {entry.name}", disable=not self.progress, leave=False,
                   dynamic_ncols=True)
        pause, used = RETRY_S[0], set()
        try:
            while missing:
                sources = await self._sources_for(entry)
                if not sources:
                    log.info("data: no source holds %s yet; asking again in %.0f s", entry.name, pause)
                    await asyncio.sleep(pause)
                    pause = min(RETRY_S[1], pause * 2)
                    continue
                used.update(sources)
                try:
                    async with asyncio.TaskGroup() as tg:
                        for source in sources:
                            tg.create_task(self._drain(source, entry, missing, have, bar))
                except BaseExceptionGroup as group:  # a full disk: one line for the user
                    known = known_failure(group)
                    if known is not None:
                        raise known from None
                    raise
                if missing:
                    await asyncio.sleep(pause)
                    pause = min(RETRY_S[1], pause * 2)
        finally:
            bar.close()
        await asyncio.to_thread(cache.finish, entry)
        took = time.monotonic() - started
        got = entry.bytes - already_bytes
        log.info("data: %s verified (%d of %d chunks fetched now, %.1f MB in %.1f s, %.1f MB/s, from %s)", entry.name,
                 entry.num_chunks() - already, entry.num_chunks(), got / 1e6, took, got / 1e6 / max(took, 1e-3),
                 ", ".join(sorted(map(_short_source, used))))
        return cache.path(entry.name)

    async def _drain(self, source: str, entry: FileEntry, missing: deque, have: set[int], bar) -> None:
        """Fetch chunks from ``source`` until none are left or it fails."""
        while missing:
            index = missing.popleft()
            try:
                data = await self._chunk(source, entry, index)
            except PeerError:
                missing.append(index)
                self._holdings.pop(source, None)
                return
            if data is None or sha256_hex(data) != entry.chunks[index]:
                missing.append(index)
                if data is not None:
                    self._refuse(source, f"served bytes of {entry.name} that the manifest does not know")
                return
            async with self._have_lock:
                await asyncio.to_thread(self.cache.put_chunk, entry, index, data, have)
            self._count(source, len(data))
            bar.update(len(data))

    async def _chunk(self, source: str, entry: FileEntry, index: int) -> bytes | None:
        if source.startswith(("http://", "https://")):
            start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
            return await asyncio.to_thread(_http_range, f"{source.rstrip('/')}/{entry.name}", start, end,
                                           self.timeout_s)
        return await self._ask_bytes(source, data_request(self.cache.manifest_sha256, "chunk", entry.name, index),
                                     max_bytes=self.manifest.chunk_bytes + 4096)

    async def _sources_for(self, entry: FileEntry) -> list[str]:
        """Peers holding ``entry``; the initial peers (the bootstrap) only when no other
        peer does, since the host's uplink is what every volunteer shares; the HTTP
        mirrors when no peer at all does."""
        await self._ask_holdings()
        holders = [p for p, (_, files) in self._holdings.items() if entry.name in files
                   and p not in self.stats.refused]
        others = [p for p in holders if p not in self.initial]
        self.rng.shuffle(others)
        sources = others[:MAX_SOURCES]
        if not sources:
            sources = [p for p in holders if p in self.initial][:MAX_SOURCES]
        if not sources:
            sources = [url for url in self.manifest.sources if url not in self.stats.refused][:MAX_SOURCES]
        return sources

    async def _ask_holdings(self) -> None:
        now = time.monotonic()
        due = [p for p in self._candidates() if now - self._holdings.get(p, (-1e9, None))[0] > HOLDINGS_TTL_S]
        self.rng.shuffle(due)

        async def ask(peer: str) -> None:
            try:
                header = await self._ask(peer, data_request(self.cache.manifest_sha256, "have"), max_bytes=8 << 20)
            except PeerError:
                self._holdings[peer] = (now, frozenset())
                return
            files = header.get("files") if header and header.get("ok") else []
            if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                self._refuse(peer, "answered 'have' with something that is not a list of names")
                files = []
            self._holdings[peer] = (now, frozenset(files))

        await asyncio.gather(*(ask(p) for p in due[:MAX_ASKED]))

    def _candidates(self) -> list[str]:
        peers = [p for p in self.peers() if p not in self.initial]
        return [p for p in dict.fromkeys(peers + self.initial) if p not in self.stats.refused]

    async def _ask(self, peer: str, request: bytes, *, max_bytes: int) -> dict | None:
        header, _ = await self._call(peer, request, max_bytes)
        return header

    async def _ask_bytes(self, peer: str, request: bytes, *, max_bytes: int) -> bytes | None:
        header, tensors = await self._call(peer, request, max_bytes)
        if not header.get("ok"):
            return None
        if len(tensors) > 1 or (tensors and tensors[0].dim() != 1):
            raise ProtocolError("a data answer carries one byte string")
        return tensors[0].numpy().tobytes() if tensors else b""

    async def _call(self, peer: str, request: bytes, max_bytes: int) -> tuple[dict, list]:
        answer = await self.transport.request(peer, protocols.DATA, request, timeout_s=self.timeout_s,
                                              max_response_bytes=max_bytes, paced_response=True)
        try:
            return decode_frame(answer, FrameLimits(max_payload_bytes=max_bytes, max_tensors=1))
        except ProtocolError as exc:
            self._refuse(peer, f"sent a malformed data answer ({exc})")
            raise

    def _refuse(self, source: str, why: str) -> None:
        if source not in self.stats.refused:
            self.stats.refused.add(source)
            log.warning("data: refusing %s for the rest of the run: %s", _short_source(source), why)
        if not source.startswith(("http://", "https://")):
            self.on_fault(source, why)

    def _count(self, source: str, nbytes: int) -> None:
        self.stats.fetched_bytes += nbytes
        self.stats.by_source[source] = self.stats.by_source.get(source, 0) + nbytes

    def _chunk_len(self, entry: FileEntry, index: int) -> int:
        start, end = entry.chunk_span(index, self.manifest.chunk_bytes)
        return end - start


def _http_range(url: str, start: int, end: int, timeout_s: float) -> bytes | None:
    """Bytes [start, end) of ``url``; None when the server does not have them."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if response.status == 206:
                return response.read(end - start + 1)
            if response.status == 200:  # a server without ranges sends the whole file
                response.read(start)
                return response.read(end - start)
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError, HTTPError, timeouts, cut bodies
        raise PeerError(f"{url}: {exc}") from None
    return None


def _short_source(source: str) -> str:
    return source if source.startswith(("http://", "https://")) else short_id(source)
