"""A node's training data, whatever its kind: windows loaded in memory (synthetic, the
bundled corpus, local files), or a prepared dataset fetched from peers (data kind
manifest): the manifest and tokenizer at join, then, on stage 0 only, the shards of the
slot it claims (data/slot_batches.py); later stages train on the targets that travel with the
activations and fetch no shards. Every node serves what its cache holds whole."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from swarm_node.data.cache import ShardCache
from swarm_node.data.claims import SlotClaims
from swarm_node.data.dataset import TokenWindows, load_windows
from swarm_node.data.fetch import DataFetcher
from swarm_node.data.serve import DataServer
from swarm_node.data.sharded_batches import ShardedBatches
from swarm_node.data.slot_batches import SlotBatches, choose_slot, default_slots
from swarm_node.data.spec import DataSpec
from swarm_node.errors import DataError
from swarm_node.net.guard import PeerGuard

log = logging.getLogger(__name__)

SLOT_CHECK_S = 5.0  # how often stage 0 looks for another peer claiming its slot
SLOT_MOVE_EVERY_S = 30.0  # at most one move to another slot this often, whoever claims ours


class RunShape(Protocol):
    """What the data reads of the run spec (spec.py's RunSpec, which holds the DataSpec)."""

    @property
    def data(self) -> DataSpec: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def seed(self) -> int: ...


class RunData:
    def __init__(self, spec: RunShape, *, cache_dir: Path, cache_gb: float | None, initial_peers: list[str],
                 peers: Callable[[], list[str]], on_fault: Callable[[str, str], None], progress: bool,
                 guard: PeerGuard | None = None, private_mirrors: bool = False):
        """``guard``: who is known to exist, for slot claims (data/claims.py) and for the
        sources of data we prefer; by default a guard of our own, whose peers are only
        those our probes reach."""
        self.spec = spec
        self.windows: TokenWindows | None = None
        self.cache: ShardCache | None = None
        self.fetcher: DataFetcher | None = None
        self.loader: SlotBatches | ShardedBatches | None = None
        self.server = DataServer(lambda: self.cache, on_fault=on_fault)
        self._initial, self._peers, self._on_fault, self._progress = initial_peers, peers, on_fault, progress
        self._private_mirrors = private_mirrors
        data = spec.data
        if data.kind == "manifest":
            held = data.path is not None  # the host's own folder: everything is there
            root = Path(data.path) if held else cache_dir / data.manifest_sha256[:16]
            self.cache = ShardCache(root, data.manifest_sha256, trust_whole_files=held,
                                    budget_bytes=None if held or cache_gb is None else int(cache_gb * 1e9))
        self.guard = guard if guard is not None else PeerGuard()
        self.clock: Callable[[], float] = time.monotonic
        self._transport = None
        self._claims = SlotClaims(dict, self.guard, None)
        self._peer_id = ""
        self._checked_at = self._moved_at = -math.inf
        self.trained_shards: deque[str] = deque(maxlen=256)  # the latest begun, oldest first

    @classmethod
    def in_memory(cls, spec: RunShape, windows: TokenWindows) -> RunData:
        """Windows already loaded (tests, benchmarks)."""
        data = cls(spec, cache_dir=Path("."), cache_gb=None, initial_peers=[], peers=list,
                   on_fault=lambda peer, why: None, progress=False)
        data.windows = windows
        return data

    @property
    def prepared(self) -> bool:
        return self.cache is not None

    async def open(self, transport, run_in_thread, manifest_timeout_s: float = 600.0) -> int:
        """Load or fetch what every stage needs; returns the vocabulary size."""
        if self.cache is None:
            self.windows = await run_in_thread(load_windows, self.spec.data, self.spec.seq_len)
            return self.windows.vocab_size
        self._transport = transport
        self.fetcher = DataFetcher(self.cache, transport, peers=self._peers, initial=self._initial,
                                   on_fault=self._on_fault, progress=self._progress,
                                   verified=self.guard.is_verified, private_mirrors=self._private_mirrors)
        manifest = await self.fetcher.fetch_manifest(manifest_timeout_s)
        if manifest.tokenizer is not None:
            await self.fetcher.fetch(manifest.tokenizer)
        return manifest.vocab_size

    async def serve(self, transport, authorize: Callable[[str], bool]) -> None:
        if self.cache is not None:
            await self.server.serve(transport, authorize)

    def open_loader(self, *, peer_id: str, batch_size: int, shard: tuple[int, int], resumed: dict | None,
                    claims: Callable[[], dict[str, int]]) -> SlotBatches | ShardedBatches:
        """Stage 0's batches: ``shard`` (id, count) for in-memory windows; a prepared
        dataset takes a slot nobody in ``claims`` (peer -> slot, as the live stage-0
        records say) holds instead."""
        spec = self.spec
        if self.cache is None:
            shard_id, num_shards = shard
            num_shards = min(num_shards, max(1, self.windows.num_train_windows // batch_size))
            loader = ShardedBatches(self.windows, batch_size=batch_size, seed=spec.seed,
                                    shard_id=shard_id % num_shards, num_shards=num_shards)
        else:
            self._claims, self._peer_id = SlotClaims(claims, self.guard, self._transport), peer_id
            num_slots = default_slots(self.fetcher.manifest, spec.data.slots)
            wanted = resumed["shard"][0] if resumed and resumed["shard"][1] == num_slots else None
            believed, unconfirmed = self._claims.split()
            slot = choose_slot(peer_id, believed, num_slots, wanted, unconfirmed)
            loader = SlotBatches(self.fetcher, seq_len=spec.seq_len, batch_size=batch_size, seed=spec.seed,
                                 slot=slot, num_slots=num_slots, on_shard=self._training_shard)
            loader.check_slot = self._check_slot
            log.info("data: slot %d of %d", slot, num_slots)
        if resumed is not None and list(loader.part) == list(resumed["shard"]):
            loader.load_state_dict(resumed)
        self.loader = loader
        return loader

    def status(self) -> dict | None:
        """For /api/status: what was fetched from whom, and served."""
        if self.fetcher is None:
            return None
        stats = self.fetcher.stats
        return {"manifest_sha256": self.cache.manifest_sha256, "fetched_bytes": stats.fetched_bytes,
                "fetched_by_source": dict(stats.by_source), "refused_sources": sorted(stats.refused),
                "served_bytes": self.server.served_bytes, "slot": self.claimed_slot(),
                "trained_shards": list(self.trained_shards)}

    def claimed_slot(self) -> int:
        return self.loader.slot if isinstance(self.loader, SlotBatches) else -1

    def _check_slot(self) -> None:
        """Every SLOT_CHECK_S: leave our slot to a believed claim with precedence (at most
        once in SLOT_MOVE_EVERY_S), and ask unverified claimants whether they exist."""
        now, loader = self.clock(), self.loader
        if now - self._checked_at < SLOT_CHECK_S:
            return
        self._checked_at = now
        believed, unconfirmed = self._claims.split()
        slot = choose_slot(self._peer_id, believed, loader.num_slots, loader.slot, unconfirmed)
        if slot != loader.slot and now - self._moved_at >= SLOT_MOVE_EVERY_S:
            self._moved_at = now
            loader.switch_slot(slot)
        self._claims.verify_soon(self._peer_id, loader.slot)

    def _training_shard(self, name: str, data_pass: int) -> None:
        self.trained_shards.append(name)
        log.info("data: training %s (pass %d, slot %d of %d)", name, data_pass, self.loader.slot,
                 self.loader.num_slots)

    async def settle_slot(self, wait_s: float) -> None:
        """Before stage 0's first batch of a prepared dataset: give peers that claimed a
        slot at the same moment time to see our claim and we theirs, ask those that
        contest ours whether they exist, then look again."""
        if isinstance(self.loader, SlotBatches):
            await asyncio.sleep(wait_s)
            await self._claims.verify(self._peer_id, self.loader.slot)
            self._checked_at = -math.inf

    async def close(self) -> None:
        await self._claims.close()
        if self.loader is not None:
            await self.loader.close()
        if self.fetcher is not None:
            await self.fetcher.close()


def prepared_tokenizer(data: DataSpec, cache_dir: Path) -> Path | None:
    """The tokenizer file of a prepared dataset on this machine (its folder, or a node's
    cache), checked against the manifest; None when the dataset is byte-level."""
    folders = ([Path(data.path)] if data.path else []) + [cache_dir / data.manifest_sha256[:16]]
    for folder in folders:
        cache = ShardCache(folder, data.manifest_sha256)
        manifest = cache.load_manifest()
        if manifest is None:
            continue
        if manifest.tokenizer is None:
            return None
        if cache.has(manifest.tokenizer):
            return cache.path(manifest.tokenizer.name)
    raise DataError(
        f"the tokenizer of this run's prepared dataset is not in {' or '.join(map(str, folders))}: "
        "pass --tokenizer FILE (a node that joined the run keeps it in its data cache)"
    )
